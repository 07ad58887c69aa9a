"""An ImageNet training script as pytorch/examples' imagenet/main.py is written (torchvision's
FakeData instead of the dataset): a torchvision model, SGD with momentum, a cosine schedule,
and the script's meters of loss and accuracy."""

import argparse

import torch
import torch.nn as nn
import torchvision
import torchvision.transforms as transforms


class AverageMeter:
    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [
            correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size)
            for k in topk
        ]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = torchvision.models.__dict__[args.arch]().to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    data = torchvision.datasets.FakeData(64, (3, 224, 224), 1000, transforms.ToTensor())
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)
    for epoch in range(args.epochs):
        losses, top1 = AverageMeter("Loss", ":.4e"), AverageMeter("Acc@1", ":6.2f")
        model.train()
        for i, (images, target) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            (acc1,) = accuracy(output, target, topk=(1,))
            losses.update(loss.item(), images.size(0))
            top1.update(acc1[0], images.size(0))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"Epoch [{epoch}][{i}] {losses} {top1}")
        scheduler.step()


if __name__ == "__main__":
    main()
