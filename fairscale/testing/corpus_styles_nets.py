"""Plain PyTorch models and vision networks in the styles users copy (our own code, written the way
each is usually written; shrunk in size only, dropout 0). Part of the conformance corpus
(:mod:`fairscale.testing.corpus_styles`).

* ``nn.Transformer`` (encoder-decoder, the defaults: post-norm, ``batch_first=False``).
* ``nn.TransformerEncoder`` classifiers, ``batch_first`` False (sequence first) and True.
* A VGG-like CNN: ``Conv2d`` + ``BatchNorm2d`` + ``nn.ReLU(inplace=True)``.
* torchvision's ResNet shape: ``BasicBlock`` and ``Bottleneck`` with ``out += identity``, in-place ReLU.
* MLP-Mixer (token-mixing MLPs over transposed patches).
* ConvNeXt blocks: depthwise 7x7 conv, permute to channels-last, LayerNorm, layer-scale ``gamma``.
* A small U-Net: down and up paths joined by ``torch.cat`` skips, ``ConvTranspose2d``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TorchSeq2Seq", "SeqFirstClassifier", "VGGBN", "ResNetMini", "MLPMixer", "ConvNeXtMini", "UNetMini"]


# ---------------------------------------------------------------------------------------------
# torch.nn transformers


class PositionalEncoding(nn.Module):
    """The sinusoidal table of PyTorch's transformer tutorial, sequence-first."""

    def __init__(self, d_model: int, dropout: float = 0.0, max_len: int = 64) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pe[: x.size(0)]
        return self.dropout(x)


class TorchSeq2Seq(nn.Module):
    """``nn.Transformer`` with its defaults (post-norm, ReLU, sequence-first), its own loss."""

    def __init__(self, vocab: int = 96, d_model: int = 32, nhead: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.src_tok_emb = nn.Embedding(vocab, d_model)
        self.tgt_tok_emb = nn.Embedding(vocab, d_model)
        self.positional_encoding = PositionalEncoding(d_model)
        self.transformer = nn.Transformer(d_model=d_model, nhead=nhead, num_encoder_layers=layers,
                                          num_decoder_layers=layers, dim_feedforward=2 * d_model, dropout=0.0)
        self.generator = nn.Linear(d_model, vocab)
        self.d_model = d_model

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        src_emb = self.positional_encoding(self.src_tok_emb(src.t()) * math.sqrt(self.d_model))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(tgt_in.t()) * math.sqrt(self.d_model))
        tgt_mask = self.transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        outs = self.transformer(src_emb, tgt_emb, tgt_mask=tgt_mask)
        logits = self.generator(outs)  # (tgt_len, batch, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.t().reshape(-1))


class SeqFirstClassifier(nn.Module):
    """``nn.TransformerEncoder`` over (sequence, batch, features) or (batch, sequence, features)
    (``batch_first``), default ``norm_first=False``; mean-pooled classifier."""

    def __init__(self, features: int = 12, d_model: int = 32, nhead: int = 4, layers: int = 2, classes: int = 8,
                 batch_first: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.input_proj = nn.Linear(features, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=2 * d_model, dropout=0.0,
                                           batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.fc = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_first:
            x = x.transpose(0, 1)  # (batch, seq, f) -> (seq, batch, f)
        h = self.encoder(self.input_proj(x))
        return self.fc(h.mean(dim=1 if self.batch_first else 0))


# ---------------------------------------------------------------------------------------------
# CNNs with batch norm and in-place ReLU


class VGGBN(nn.Module):
    def __init__(self, cfg: tuple[int | str, ...] = (8, "M", 16, "M", 32), num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for v in cfg:
            if v == "M":
                layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
            else:
                layers += [nn.Conv2d(in_channels, int(v), kernel_size=3, padding=1), nn.BatchNorm2d(int(v)),
                           nn.ReLU(inplace=True)]
                in_channels = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(in_channels * 4, 32), nn.ReLU(True), nn.Dropout(p=0.0),
                                        nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNetMini(nn.Module):
    """torchvision's ResNet with one BasicBlock stage and one Bottleneck stage."""

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(BasicBlock, width, 2)
        self.layer2 = self._make_layer(Bottleneck, width, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int = 1
                    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


# ---------------------------------------------------------------------------------------------
# MLP-Mixer


class MlpBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MixerBlock(nn.Module):
    def __init__(self, num_patches: int, dim: int, tokens_hidden: int, channels_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mixing = MlpBlock(num_patches, tokens_hidden)
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mixing = MlpBlock(dim, channels_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x).transpose(1, 2)
        x = x + self.token_mixing(y).transpose(1, 2)
        return x + self.channel_mixing(self.norm2(x))


class MLPMixer(nn.Module):
    def __init__(self, image_size: int = 16, patch_size: int = 4, dim: int = 32, depth: int = 2,
                 num_classes: int = 10) -> None:
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.stem = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.blocks = nn.Sequential(*[MixerBlock(num_patches, dim, dim // 2, dim * 4) for _ in range(depth)])
        self.pre_head_layer_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)  # (n, patches, dim)
        x = self.blocks(x)
        x = self.pre_head_layer_norm(x)
        return self.head(x.mean(dim=1))


# ---------------------------------------------------------------------------------------------
# ConvNeXt


class LayerNorm2d(nn.Module):
    """ConvNeXt's channels_first LayerNorm, written out over dim 1."""

    def __init__(self, normalized_shape: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, layer_scale_init_value: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale_init_value * torch.ones(dim)) if layer_scale_init_value > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input = x
        x = self.dwconv(x)
        x = x.permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
        x = self.norm(x)
        x = self.pwconv1(x)
        x = self.act(x)
        x = self.pwconv2(x)
        if self.gamma is not None:
            x = self.gamma * x
        x = x.permute(0, 3, 1, 2)
        return input + x


class ConvNeXtMini(nn.Module):
    def __init__(self, num_classes: int = 10, dims: tuple[int, int] = (16, 32), depths: tuple[int, int] = (1, 1)
                 ) -> None:
        super().__init__()
        self.downsample_layers = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=2, stride=2), LayerNorm2d(dims[0])),
            nn.Sequential(LayerNorm2d(dims[0]), nn.Conv2d(dims[0], dims[1], kernel_size=2, stride=2)),
        ])
        self.stages = nn.ModuleList(nn.Sequential(*[ConvNeXtBlock(d) for _ in range(n)])
                                    for d, n in zip(dims, depths))
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.head(self.norm(x.mean([-2, -1])))


# ---------------------------------------------------------------------------------------------
# U-Net


class DoubleConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False), nn.GroupNorm(4, out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False), nn.GroupNorm(4, out_channels),
            nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.double_conv(x)


class Up(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        x1 = self.up(x1)
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class UNetMini(nn.Module):
    """A two-level U-Net predicting a class per pixel (segmentation)."""

    def __init__(self, n_channels: int = 3, n_classes: int = 4, base: int = 8) -> None:
        super().__init__()
        self.inc = DoubleConv(n_channels, base)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(base, 2 * base))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(2 * base, 4 * base))
        self.up1 = Up(4 * base, 2 * base)
        self.up2 = Up(2 * base, base)
        self.outc = nn.Conv2d(base, n_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x = self.up1(x3, x2)
        x = self.up2(x, x1)
        return self.outc(x)
