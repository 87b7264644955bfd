"""A ResNet-50-shaped LightningModule with tiny widths, for tests and benchmarks.

The layout of He et al. 2016 ("Deep Residual Learning for Image Recognition", Table 1, 50-layer
column): a 7x7 stem and max-pool, then four stages of 3, 4, 6 and 3 bottleneck blocks (1x1 reduce,
3x3, 1x1 expand by 4, each followed by BatchNorm), the first block of each stage projecting its
shortcut, then global average pooling and one linear classifier. Widths start at ``width`` channels
instead of 64, so that it trains on a CPU in milliseconds; nothing beyond torch is needed. The last
BatchNorm of each block starts at zero scale (Goyal et al. 2017, "Accurate, Large Minibatch SGD"),
which keeps the first gradients moderate although the last stages normalise over a few values. The
stages are ``layer1`` .. ``layer4`` (``nn.Sequential`` of ``Bottleneck``), as in torchvision, so
their blocks change width from one stage to the next.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

STAGE_BLOCKS = (3, 4, 6, 3)  # ResNet-50
EXPANSION = 4


class Bottleneck(nn.Module):
    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1, self.bn1 = nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels)
        nn.init.zeros_(self.bn3.weight)  # each block starts as its shortcut (Goyal et al. 2017, section 5.1)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return F.relu(self.bn3(self.conv3(x)) + shortcut)


class ResNet(L.LightningModule):
    """Images (B, 3, H, W) and labels (B,) -> cross-entropy; SGD with momentum, as in the paper."""

    def __init__(self, width: int = 4, num_classes: int = 10, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        channels = width
        for stage, blocks in enumerate(STAGE_BLOCKS):
            stage_width = width * 2**stage
            layer = [Bottleneck(channels, stage_width, stride=1 if stage == 0 else 2)]
            channels = stage_width * EXPANSION
            layer += [Bottleneck(channels, stage_width) for _ in range(blocks - 1)]
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layer))
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def image_data(n: int = 64, size: int = 16, num_classes: int = 10, seed: int = 0):
    """Random images whose label is the brightest of ``num_classes`` fixed patterns: learnable."""
    from tests.helpers.parity import TensorDataset

    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, size, size, generator=g)
    patterns = torch.randn(num_classes, 3, size, size, generator=g)
    labels = torch.einsum("nchw,kchw->nk", images, patterns).argmax(1)
    return TensorDataset(images, labels)
