"""The built-in models: the standard sizes and shapes."""

import pytest
import torch

from overlapkit.models import BertClassifier, ResNet


@pytest.mark.parametrize(
    "depth, stem, size, params",
    [
        ("resnet18", "cifar", 32, 11_173_962),
        ("resnet18", "imagenet", 64, 11_181_642),
        ("resnet50", "cifar", 32, 23_520_842),
        ("resnet50", "imagenet", 64, 23_528_522),
    ],
)
def test_resnets_have_the_standard_parameter_counts(depth, stem, size, params):
    model = ResNet(depth, stem, num_classes=10)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.randn(2, 3, size, size)).shape == (2, 10)
    assert [name for name, _ in model.named_children()] == [
        "stem",
        "layer1",
        "layer2",
        "layer3",
        "layer4",
        "head",
    ]


def test_resnet_with_the_imagenet_stem_takes_224():
    model = ResNet("resnet18", "imagenet", num_classes=1000, width=8)
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_bert_masks_padding_and_classifies():
    torch.manual_seed(0)
    model = BertClassifier(
        vocab_size=100, hidden=32, layers=2, heads=4, max_len=16, num_classes=3
    ).eval()
    tokens = torch.randint(2, 100, (2, 10))
    tokens[:, 0] = 1
    assert model(tokens).shape == (2, 3)
    # Padding does not change the prediction for the real tokens.
    padded = torch.cat([tokens, torch.zeros(2, 6, dtype=torch.long)], dim=1)
    assert torch.allclose(model(tokens), model(padded), atol=1e-5)
    with pytest.raises(ValueError, match="exceeds max_len"):
        model(torch.ones(1, 17, dtype=torch.long))
