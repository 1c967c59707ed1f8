"""PyTorch's DCGAN example, in its shape: a DataLoader over in-memory "images", a generator and a
discriminator with two Adam optimizers, both stepped on every batch (D on real, D on fake.detach(),
optimizerD.step(); then G through D, optimizerG.step()).

Prints its own throughput every --print-freq batches (samples = real images consumed):
    [0/40][10/64] Loss_D: 1.2345 Loss_G: 0.9876 D(x): 0.51 D(G(z)): 0.48 / 0.47 samples/s 512.3
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),  # 4x4
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),  # 8
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),  # 16
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())  # 32x32

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),  # 16
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),  # 4
            nn.Conv2d(ndf * 4, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--nz", type=int, default=32)
    parser.add_argument("--ngf", type=int, default=32)
    parser.add_argument("--ndf", type=int, default=32)
    parser.add_argument("--niter", type=int, default=40, help="epochs")
    parser.add_argument("--lr", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--print-freq", type=int, default=10)
    parser.add_argument("--seed", type=int, default=999)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    nc = 3
    g = torch.Generator().manual_seed(args.seed)
    images = torch.rand(args.samples, nc, 32, 32, generator=g) * 2 - 1
    dataset = TensorDataset(images)
    dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)

    netG = Generator(args.nz, args.ngf, nc)
    netG.apply(weights_init)
    netD = Discriminator(args.ndf, nc)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(args.batch_size, args.nz, 1, 1)
    real_label, fake_label = 1, 0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))

    window_samples, window_start = 0, time.time()
    for epoch in range(args.niter):
        for i, data in enumerate(dataloader, 0):
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            netD.zero_grad()
            real_cpu = data[0]
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()

            noise = torch.randn(batch_size, args.nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()

            window_samples += batch_size
            if (i + 1) % args.print_freq == 0:
                now = time.time()
                rate = window_samples / (now - window_start)
                window_samples, window_start = 0, now
                print(f"[{epoch}/{args.niter}][{i + 1}/{len(dataloader)}] Loss_D: {errD.item():.4f} "
                      f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f} "
                      f"samples/s {rate:.1f}", flush=True)
        with torch.no_grad():
            netG(fixed_noise)  # the example saves these as an image grid every epoch


if __name__ == "__main__":
    main()
