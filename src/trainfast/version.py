"""trainfast's version: a leaf module, so that any module can name it without importing the whole package."""

__version__ = "0.1.0"
