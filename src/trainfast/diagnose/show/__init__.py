"""The doctor's report shown: in the terminal (terminal.py), as an HTML page (html.py), as TensorBoard scalars
(scalars.py), all from its JSON."""
