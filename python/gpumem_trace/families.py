"""The seed's synthetic families in PyTorch (GPUMemNet's generator scripts, restated).

Each function takes the batch size and the native spec's keys and returns (model, sample batch,
loss function). The workload runner (``run.py``) trains them on a GPU; the tests trace them as
``py:`` references to check that gpumem's native Rust families give the same memory."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTS = {
    "relu": nn.ReLU,
    "leaky_relu": nn.LeakyReLU,
    "prelu": nn.PReLU,
    "elu": nn.ELU,
    "selu": nn.SELU,
    "tanh": nn.Tanh,
    "softplus": nn.Softplus,
    "swish": nn.SiLU,
    "mish": nn.Mish,
    "gelu": nn.GELU,
    "identity": nn.Identity,
}


def mlp(
    batch_size,
    input,
    output,
    depth,
    arch="pyramid",
    act="relu",
    dropout=0.0,
    batchnorm=False,
    head="identity",
):
    layers, inf = [], input

    def block(i, o):
        layers.append(nn.Linear(i, o))
        if batchnorm:
            layers.append(nn.BatchNorm1d(o))
        layers.append(ACTS[act]())
        if dropout > 0:
            layers.append(nn.Dropout(dropout))

    if arch in ("pyramid", "bottleneck"):
        for _ in range(depth + (1 if arch == "bottleneck" else 0)):
            o = max(int(inf * 0.5), output)
            block(inf, o)
            inf = o
    elif arch == "uniform":
        for _ in range(depth):
            block(input, input)
    else:
        dec = (input - output) // depth
        for _ in range(depth):
            o = max(inf - dec, output)
            block(inf, o)
            inf = o
    layers.append(nn.Linear(inf, output))
    if output > 1:
        layers.append(nn.Softmax(dim=1))
    elif head == "sigmoid":
        layers.append(nn.Sigmoid())
    model = nn.Sequential(*layers)
    batch = (torch.randn(batch_size, input), torch.randint(0, max(output, 2), (batch_size,)))
    if output > 1:
        return model, batch, lambda out, b: F.cross_entropy(out, b[1])
    return (
        model,
        batch,
        lambda out, b: F.binary_cross_entropy_with_logits(out, b[1].view(-1, 1).float()),
    )


class _Block(nn.Module):
    def __init__(self, cin, cout, act, k=3, stride=1, pad=1, bn=False, dropout=0.0):
        super().__init__()
        layers = [nn.Conv2d(cin, cout, k, stride, pad)]
        if bn:
            layers.append(nn.BatchNorm2d(cout))
        layers.append(ACTS[act]())
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        return self.block(x)


class _Residual(nn.Module):
    def __init__(self, cin, cout, stride, act, bn, dropout):
        super().__init__()
        self.conv1 = _Block(cin, cout, act, stride=stride, bn=bn, dropout=dropout)
        self.conv2 = _Block(cout, cout, act, bn=bn, dropout=dropout)
        if cin != cout or stride != 1:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride), nn.BatchNorm2d(cout) if bn else nn.Identity()
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        r = self.shortcut(x)
        return self.conv2(self.conv1(x)) + r


class _Dense(nn.Module):
    def __init__(self, cin, act, bn, dropout):
        super().__init__()
        self.layers = nn.ModuleList(
            [_Block(cin + i * 32, 32, act, bn=bn, dropout=dropout) for i in range(4)]
        )

    def forward(self, x):
        feats = [x]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return torch.cat(feats, 1)


class _Transition(nn.Module):
    def __init__(self, cin, cout, bn):
        super().__init__()
        self.conv = _Block(cin, cout, "relu", k=1, pad=0, bn=bn)
        self.pool = nn.AvgPool2d(2, 2)

    def forward(self, x):
        x = self.conv(x)
        return self.pool(x) if x.size(2) > 1 else x


def cnn(
    batch_size,
    classes,
    filters,
    depth,
    input,
    channels=3,
    arch="pyramid",
    act="relu",
    dropout=0.0,
    batchnorm=False,
    pooling=True,
    pool_every=5,
):
    blocks, cin, size, base = [], channels, input, filters
    if pool_every == 0:
        pool_every = max(1, math.ceil(depth / max(1, int(math.log2(input // 7)))))
    if arch == "residual":
        g = (2048 / base) ** (1 / depth)
        for i in range(depth // 2):
            out = min(int(base * g**i), 2048)
            stride = 2 if i % 2 == 1 and size > 7 else 1
            blocks.append(_Residual(cin, out, stride, act, batchnorm, dropout))
            cin = out
            if stride == 2:
                size //= 2
            if size <= 7:
                break
    elif arch == "dense":
        units = depth // 4
        for i in range(units):
            blocks.append(_Dense(cin, act, batchnorm, dropout))
            cin += 128
            if i % pool_every == 0 and i != units - 1:
                blocks.append(_Transition(cin, cin // 2, batchnorm))
                cin //= 2
    else:
        for i in range(depth):
            if arch == "pyramid":
                out = min(int(base * ((2048 / base) ** (1 / depth)) ** i), 2048)
            elif arch == "reverse_pyramid":
                out = max(int(base / ((2048 / base) ** (1 / depth)) ** i), 1)
            elif arch == "bottleneck":
                g = 2 if depth <= 2 else (2048 / base) ** (1 / (depth - 1))
                out = base * 2 if i == 0 else min(int(base * g ** (i - 1)), 2048)
            elif arch == "gradual":
                out = min(int(base * ((2048 / base) ** (1 / (2 * depth))) ** i), 2048)
            elif arch == "hourglass":
                c = depth // 2
                out = (
                    min(int(base * ((2048 / base) ** (1 / c)) ** i), 2048)
                    if i < c
                    else max(
                        int(base * ((2048 / base) ** (1 / (depth - c))) ** (depth - i - 1)), base
                    )
                )
            else:
                out = base
            blocks.append(_Block(cin, out, act, bn=batchnorm, dropout=dropout))
            cin = out
            if pooling and i % pool_every == 0 and i != 0 and size > 7:
                blocks.append(nn.MaxPool2d(2, 2))
                size //= 2

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)
            self.pool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(cin, classes)
            self.final = nn.Softmax(dim=1) if classes > 1 else nn.Sigmoid()

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            x = self.pool(x)
            x = torch.flatten(x, 1)
            x = self.fc(x)
            return self.final(x)

    batch = (
        torch.randn(batch_size, channels, input, input),
        torch.randint(0, max(classes, 2), (batch_size,)),
    )
    return Net(), batch, lambda out, b: F.cross_entropy(out, b[1])


def transformer(
    batch_size, vocab, embed, layers, heads, ff, seq, classes, dropout=0.1, arch="standard"
):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, embed)
            self.positional_encoding = nn.Parameter(torch.zeros(1, seq, embed))
            enc = lambda: nn.TransformerEncoderLayer(embed, heads, ff, dropout, batch_first=True)
            dec = lambda: nn.TransformerDecoderLayer(embed, heads, ff, dropout, batch_first=True)
            if arch == "standard":
                self.enc = nn.TransformerEncoder(enc(), layers, enable_nested_tensor=False)
            elif arch == "decoder_only":
                self.dec = nn.TransformerDecoder(dec(), layers)
            else:
                self.enc = nn.TransformerEncoder(enc(), layers // 2, enable_nested_tensor=False)
                self.dec = nn.TransformerDecoder(dec(), layers // 2)
            self.fc_out = nn.Linear(embed, classes)

        def forward(self, x):
            x = self.embedding(x) + self.positional_encoding
            if arch == "standard":
                x = self.enc(x)
            elif arch == "decoder_only":
                x = self.dec(x, x)
            else:
                memory = self.enc(x)
                x = self.dec(x, memory)
            x = x.mean(dim=1)
            output = self.fc_out(x)
            return output

    batch = (torch.randint(0, vocab, (batch_size, seq)), torch.randint(0, classes, (batch_size,)))
    return Net(), batch, lambda out, b: F.cross_entropy(out, b[1])
