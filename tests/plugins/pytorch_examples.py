"""pytorch/examples scripts ported to the Session API, kept close to the originals
(small sizes; nothing downloaded: synthetic data, VGG16 randomly initialised).

- ``time_sequence_prediction/train.py``: an LSTM trained with LBFGS, whose
  ``optimizer.step(closure)`` runs forward and backward up to 20 times per step.
- ``fast_neural_style/neural_style/neural_style.py`` (train): a transformer net
  trained with Adam against a frozen VGG16's features.
- ``mnist_forward_forward/main.py``: Hinton's forward-forward, each layer trained in
  turn by its own Adam on its own local loss, many updates per batch; no global backward.
- ``gcn/main.py``: a graph convolutional network trained full-batch, one forward over
  the whole graph per epoch, train/val/test masks, no DataLoader.
- ``vae/main.py``: a variational autoencoder whose forward draws its noise
  (``torch.randn_like``), its loss summed over the batch, a test pass and a sample drawn
  after each epoch.
- ``siamese_network/main.py``: pairs of images drawn at random (``random``, unseeded)
  in the dataset's ``__getitem__``, BCELoss, Adadelta, a StepLR stepped per epoch.
- pytorch/tutorials' ``intermediate_source/reinforcement_q_learning.py``: DQN on a
  CartPole of its own (gymnasium is not installed), no DataLoader: batches sampled
  from a replay memory, a target network soft-updated every step.
- karpathy/makemore's ``makemore.py``: a character-level Transformer (or Bigram) on a
  list of names, an ``InfiniteDataLoader`` (a DataLoader over a ``RandomSampler`` with
  replacement, 1e10 samples, read with ``next()``), AdamW, a ``while True`` loop with a
  max-steps break, an evaluation every few steps saving the best model.
- pytorch/tutorials' ``intermediate_source/char_rnn_classification_tutorial.py``: a
  CharRNN (``nn.RNN``) over one-hot names, no DataLoader: each epoch the indices
  ``random.shuffle``d and ``np.array_split`` into minibatches, one forward per name.
- karpathy/llm.c's ``train_gpt2.py``: GPT-2 on .bin token shards read by its own
  ``DistributedDataLoader`` (``next_batch()``), gradient accumulation with
  ``model.require_backward_grad_sync``, AdamW or ZeroRedundancyOptimizer
  (``--zero_stage 1``), a cosine lr set by hand, clip_grad_norm_, a periodic val loss.
- pytorch/tutorials' ``beginner_source/transfer_learning_tutorial.py``: finetuning a
  resnet18 (TinyResNet here) with its ``fc`` replaced, ``train_model``'s train and val
  phases each epoch through one model, a StepLR, the best weights kept and loaded back.

Each runs as the plain script (``session=None``) or ported; the 2-rank programs run
inside `launch_local`'s ranks (gloo on localhost)."""

from __future__ import annotations

import copy
import glob
import math
import os
import random
import re
import string
import unicodedata
from collections import deque, namedtuple
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import count
from math import ceil
from tempfile import TemporaryDirectory
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817 - the script's
from torch.optim import LBFGS, Adadelta, Adam
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
)

from overlapkit import Session, get_optimization
from overlapkit.runtime.distributed import init_world


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# ------------------------------------------------------ time_sequence_prediction
class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def sine_waves(N: int = 7, L: int = 40, T: int = 20) -> np.ndarray:
    """generate_sine_wave.py's data (it saves traindata.pt), N waves of length L."""
    rng = np.random.RandomState(2)
    x = np.empty((N, L), "int64")
    x[:] = np.array(range(L)) + rng.randint(-4 * T, 4 * T, N).reshape(N, 1)
    return np.sin(x / 1.0 / T).astype("float64")


def time_sequence_prediction(
    session: Session | None,
    steps: int = 3,
    stop_at: int | None = None,
    session_calls: bool = False,
) -> dict[str, Any]:
    """train.py's loop: ``steps`` LBFGS steps over the whole training set, a test
    prediction after each (no plot). Ported: the training set is the one batch of a
    list given to `prepare`, each epoch one step; ``stop_at``: the script stops before
    that step (a checkpoint resumes it); ``session_calls``: the closure's forward and
    backward through ``session.forward()`` and ``session.backward``. On several ranks each trains its shard of the
    rows. Returns every closure's loss, the test losses, the parameters and the summary."""
    np.random.seed(0)
    torch.manual_seed(0)
    data = sine_waves()
    shard = session.data_shard if session is not None else (0, 1)
    input = torch.from_numpy(data[3:, :-1])[shard[0] :: shard[1]]
    target = torch.from_numpy(data[3:, 1:])[shard[0] :: shard[1]]
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    seq = Sequence()
    seq.double()
    criterion = nn.MSELoss()
    optimizer = LBFGS(seq.parameters(), lr=0.8)
    loader: Any = [(input, target)]
    first = 0
    if session is not None:
        seq, optimizer, loader = session.prepare(seq, optimizer, loader)
        first = session.start().epoch
    losses, test_losses = [], []
    for i in range(first, steps):
        if i == stop_at:
            break
        for input, target in loader:

            def closure():
                optimizer.zero_grad()
                if session_calls:
                    with session.forward():
                        out = seq(input)  # noqa: B023
                        loss = criterion(out, target)  # noqa: B023
                    losses.append(loss.item())
                    session.backward(loss)
                    return loss
                out = seq(input)  # noqa: B023 - called in this iteration, as in train.py
                loss = criterion(out, target)  # noqa: B023
                losses.append(loss.item())
                loss.backward()
                return loss

            optimizer.step(closure)
        with torch.no_grad():
            future = 20
            pred = seq(test_input, future=future)
            test_losses.append(criterion(pred[:, :-future], test_target).item())
    summary = session.finish() if session is not None else None
    return {"losses": losses, "test": test_losses, "params": flat(seq), "summary": summary}


# ------------------------------------------------------------- fast_neural_style
class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super().__init__()
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.relu(self.in1(self.conv1(x)))
        return self.in2(self.conv2(out)) + x


class UpsampleConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        if self.upsample:
            x = nn.functional.interpolate(x, mode="nearest", scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x))


class TransformerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = ConvLayer(3, 32, kernel_size=9, stride=1)
        self.in1 = nn.InstanceNorm2d(32, affine=True)
        self.conv2 = ConvLayer(32, 64, kernel_size=3, stride=2)
        self.in2 = nn.InstanceNorm2d(64, affine=True)
        self.conv3 = ConvLayer(64, 128, kernel_size=3, stride=2)
        self.in3 = nn.InstanceNorm2d(128, affine=True)
        self.res = nn.Sequential(*[ResidualBlock(128) for _ in range(5)])
        self.deconv1 = UpsampleConvLayer(128, 64, kernel_size=3, stride=1, upsample=2)
        self.in4 = nn.InstanceNorm2d(64, affine=True)
        self.deconv2 = UpsampleConvLayer(64, 32, kernel_size=3, stride=1, upsample=2)
        self.in5 = nn.InstanceNorm2d(32, affine=True)
        self.deconv3 = ConvLayer(32, 3, kernel_size=9, stride=1)
        self.relu = nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.relu(self.in3(self.conv3(y)))
        y = self.res(y)
        y = self.relu(self.in4(self.deconv1(y)))
        y = self.relu(self.in5(self.deconv2(y)))
        return self.deconv3(y)


def vgg16_features() -> nn.Sequential:
    """torchvision's ``vgg16().features`` up to relu4_3 (its indices), randomly
    initialised: the real script downloads ImageNet weights."""
    layers: list[nn.Module] = []
    channels = 3
    for width in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512):
        if width == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU()]
            channels = width
    return nn.Sequential(*layers)


class Vgg16(nn.Module):
    def __init__(self, requires_grad=False):
        super().__init__()
        features = vgg16_features()
        self.slice1, self.slice2 = nn.Sequential(), nn.Sequential()
        self.slice3, self.slice4 = nn.Sequential(), nn.Sequential()
        for x in range(4):
            self.slice1.add_module(str(x), features[x])
        for x in range(4, 9):
            self.slice2.add_module(str(x), features[x])
        for x in range(9, 16):
            self.slice3.add_module(str(x), features[x])
        for x in range(16, 23):
            self.slice4.add_module(str(x), features[x])
        if not requires_grad:
            for param in self.parameters():
                param.requires_grad = False

    def forward(self, X):
        h_relu1_2 = h = self.slice1(X)
        h_relu2_2 = h = self.slice2(h)
        h_relu3_3 = h = self.slice3(h)
        h_relu4_3 = self.slice4(h)
        vgg_outputs = namedtuple("VggOutputs", ["relu1_2", "relu2_2", "relu3_3", "relu4_3"])
        return vgg_outputs(h_relu1_2, h_relu2_2, h_relu3_3, h_relu4_3)


def gram_matrix(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


def normalize_batch(batch):
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    batch = batch.div_(255.0)
    return (batch - mean) / std


def fast_neural_style(
    session: Session | None,
    epochs: int = 2,
    stop_after: int | None = None,
    register_vgg: bool = False,
    vgg_seed: int = 0,
    batch_size: int = 2,
    images: int = 6,
    size: int = 16,
) -> dict[str, Any]:
    """neural_style.py's train(): ``images`` synthetic images (ImageFolder's, already
    resized, as 0-255 tensors) in batches, a style image, content and style losses
    through the frozen VGG16. Ported: ``register_vgg``: the VGG given to
    `Session.start` too; ``stop_after``: the script stops after that many steps (a
    checkpoint resumes it). ``vgg_seed``: the seed its random weights are drawn with
    (the real script's weights are the same everywhere). Returns each step's total
    loss, the transformer's and VGG's parameters and the summary."""
    torch.manual_seed(42)
    content = torch.rand(images, 3, size, size).mul(255)
    style = torch.rand(3, size, size).mul(255)
    dataset = TensorDataset(content, torch.zeros(images, dtype=torch.long))
    sampler = None
    if session is not None and session.world.world_size > 1:
        index, count = session.data_shard
        sampler = DistributedSampler(dataset, count, index, shuffle=False)
    train_loader: Any = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    transformer = TransformerNet()
    optimizer = Adam(transformer.parameters(), 1e-3)
    mse_loss = nn.MSELoss()
    torch.manual_seed(vgg_seed)
    vgg = Vgg16(requires_grad=False)
    torch.manual_seed(42)
    style = style.repeat(batch_size, 1, 1, 1)
    first = 0
    if session is not None:
        transformer, optimizer, train_loader = session.prepare(transformer, optimizer, train_loader)
        start = session.start(**({"vgg": vgg} if register_vgg else {}))
        first = start.epoch
    features_style = vgg(normalize_batch(style))
    gram_style = [gram_matrix(y) for y in features_style]
    content_weight, style_weight = 1e5, 1e10

    losses, steps = [], 0
    for _e in range(first, epochs):
        transformer.train()
        for _batch_id, (x, _) in enumerate(train_loader):
            n_batch = len(x)
            optimizer.zero_grad()
            y = transformer(x)
            y = normalize_batch(y)
            x = normalize_batch(x)
            features_y = vgg(y)
            features_x = vgg(x)
            content_loss = content_weight * mse_loss(features_y.relu2_2, features_x.relu2_2)
            style_loss = 0.0
            for ft_y, gm_s in zip(features_y, gram_style, strict=True):
                style_loss += mse_loss(gram_matrix(ft_y), gm_s[:n_batch, :, :])
            style_loss *= style_weight
            total_loss = content_loss + style_loss
            total_loss.backward()
            optimizer.step()
            losses.append(total_loss.item())
            steps += 1
            if steps == stop_after:
                break
        if steps == stop_after:
            break
    summary = session.finish() if session is not None else None
    return {"losses": losses, "params": flat(transformer), "vgg": flat(vgg), "summary": summary}


# --------------------------------------------------------- mnist_forward_forward
# main.py's globals, read by its Layer: its argparse defaults, but 5 updates per layer.
args = SimpleNamespace(lr=0.03, threshold=2.0, epochs=5, log_interval=10)
device = torch.device("cpu")


def get_y_neg(y):
    y_neg = y.clone()
    for idx, y_samp in enumerate(y):
        allowed_indices = list(range(10))
        allowed_indices.remove(y_samp.item())
        y_neg[idx] = torch.tensor(allowed_indices)[
            torch.randint(len(allowed_indices), size=(1,))
        ].item()
    return y_neg.to(device)


def overlay_y_on_x(x, y, classes=10):
    x_ = x.clone()
    x_[:, :classes] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class Net(torch.nn.Module):
    def __init__(self, dims, module_list=False):
        super().__init__()
        # main.py keeps its layers in a plain list, which nn.Module does not see (no
        # parameters, an empty state_dict); ``module_list``: an nn.ModuleList instead.
        self.layers = nn.ModuleList() if module_list else []
        for d in range(len(dims) - 1):
            self.layers.append(Layer(dims[d], dims[d + 1]).to(device))

    def predict(self, x):
        goodness_per_label = []
        for label in range(10):
            h = overlay_y_on_x(x, label)
            goodness = []
            for layer in self.layers:
                h = layer(h)
                goodness = goodness + [h.pow(2).mean(1)]
            goodness_per_label += [sum(goodness).unsqueeze(1)]
        goodness_per_label = torch.cat(goodness_per_label, 1)
        return goodness_per_label.argmax(1)

    def train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for _i, layer in enumerate(self.layers):
            h_pos, h_neg = layer.train(h_pos, h_neg)


class Layer(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.relu = torch.nn.ReLU()
        self.opt = Adam(self.parameters(), lr=args.lr)
        self.threshold = args.threshold
        self.num_epochs = args.epochs
        self.losses = []  # main.py prints every log_interval-th

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg):
        for _i in range(self.num_epochs):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log1p(
                torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))
            ).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.losses.append(loss.item())
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


def forward_forward(
    session: Session | None,
    train_size: int = 64,
    samples: int = 64,
    module_list: bool = True,
    prepare_last: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """main.py on ``samples`` synthetic 32-pixel "images" of 10 classes: a Net of two
    layers trained layer by layer on each batch of ``train_size`` (main.py's one batch,
    the whole set, when they are equal), then its train error. ``module_list``: Net's
    layers in an nn.ModuleList (main.py's plain list hides them from nn.Module). Ported:
    the loader given to `prepare` with the last layer's Adam (``prepare_last``; else
    none), the other layers' Adams registered; ``stop_after``: the script stops after
    that many batches (a checkpoint resumes it). Returns every update's loss by layer,
    the error, the parameters and the summary."""
    torch.manual_seed(1)
    x_all, y_all = torch.randn(samples, 32), torch.randint(0, 10, (samples,))
    dataset = TensorDataset(x_all, y_all)
    sampler = None
    if session is not None and session.world.world_size > 1:
        index, count = session.data_shard
        sampler = DistributedSampler(dataset, count, index, shuffle=False)
    train_loader: Any = DataLoader(dataset, batch_size=train_size, sampler=sampler)
    net = Net([32, 16, 16], module_list)
    if session is not None:
        last = net.layers[-1].opt if prepare_last else None
        _, _, train_loader = session.prepare(net, last, train_loader)  # ddp_overlap: a DDP
        opts = {f"opt{i}": layer.opt for i, layer in enumerate(net.layers)}
        if prepare_last:
            del opts[f"opt{len(net.layers) - 1}"]
        session.start(**opts)
    for batch, (x, y) in enumerate(train_loader):
        x_pos = overlay_y_on_x(x, y)
        y_neg = get_y_neg(y)
        x_neg = overlay_y_on_x(x, y_neg)
        net.train(x_pos, x_neg)
        if batch + 1 == stop_after:
            break
    error = 1.0 - net.predict(x_all).eq(y_all).float().mean().item()
    summary = session.finish() if session is not None else None
    params = torch.cat([flat(layer) for layer in net.layers])
    losses = [layer.losses for layer in net.layers]
    return {"losses": losses, "error": error, "params": params, "summary": summary}


# ------------------------------------------------------------------------- gcn
class GraphConv(nn.Module):
    def __init__(self, input_dim, output_dim, use_bias=False):
        super().__init__()
        self.kernel = nn.Parameter(torch.Tensor(input_dim, output_dim))
        nn.init.xavier_normal_(self.kernel)
        self.bias = None
        if use_bias:
            self.bias = nn.Parameter(torch.Tensor(output_dim))
            nn.init.zeros_(self.bias)

    def forward(self, input_tensor, adj_mat):
        support = torch.mm(input_tensor, self.kernel)
        output = torch.spmm(adj_mat, support)
        if self.bias is not None:
            output = output + self.bias
        return output


class GCN(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, use_bias=True, dropout_p=0.1):
        super().__init__()
        self.gc1 = GraphConv(input_dim, hidden_dim, use_bias=use_bias)
        self.gc2 = GraphConv(hidden_dim, output_dim, use_bias=use_bias)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, input_tensor, adj_mat):
        x = self.gc1(input_tensor, adj_mat)
        x = F.relu(x)
        x = self.dropout(x)
        x = self.gc2(x, adj_mat)
        return F.log_softmax(x, dim=1)


def synthetic_cora(nodes: int = 60, words: int = 20, classes: int = 3, edges: int = 150):
    """load_cora()'s tensors for a random graph: bag-of-words features scaled by their
    row sums, labels, and the renormalised adjacency D^-1/2 (A + I) D^-1/2 (sparse)."""
    features = (torch.rand(nodes, words) < 0.2).float()
    labels = torch.randint(0, classes, (nodes,))
    scale_vector = 1 / torch.sum(features, dim=1)
    scale_vector[scale_vector == float("inf")] = 0
    features = torch.diag(scale_vector).to_sparse() @ features
    cites = torch.randint(0, nodes, (2, edges))
    adj_mat = torch.sparse_coo_tensor(cites, torch.ones(edges), (nodes, nodes))
    adj_mat = torch.eye(nodes) + adj_mat
    degree_mat = torch.sqrt(1 / torch.sum(adj_mat, dim=1))
    degree_mat[degree_mat == float("inf")] = 0
    degree_mat = torch.diag(degree_mat).to_sparse()
    adj_mat = degree_mat @ adj_mat @ degree_mat
    return features.to_sparse(), labels, adj_mat.to_sparse()


def train_iter(epoch, model, optimizer, criterion, input, target, mask_train, mask_val, log):
    model.train()
    optimizer.zero_grad()
    output = model(*input)
    loss = criterion(output[mask_train], target[mask_train])
    loss.backward()
    optimizer.step()
    # main.py prints these every print_every epochs
    loss_train, acc_train = test(model, criterion, input, target, mask_train)
    loss_val, acc_val = test(model, criterion, input, target, mask_val)
    log.append((epoch, loss.item(), loss_train, acc_train, loss_val, acc_val))


def test(model, criterion, input, target, mask):
    model.eval()
    with torch.no_grad():
        output = model(*input)
        output, target = output[mask], target[mask]
        loss = criterion(output, target)
        acc = (output.argmax(dim=1) == target).float().sum() / len(target)
    return loss.item(), acc.item()


def gcn(session: Session | None, epochs: int = 6, stop_at: int | None = None) -> dict[str, Any]:
    """main.py's training on `synthetic_cora`'s graph (dropout 0.5, Adam with weight
    decay, its masks from one randperm). Ported: the graph is the one batch of a list
    given to `prepare`, each epoch one step; ``stop_at``: the script stops before that
    epoch (a checkpoint resumes it). Returns each epoch's losses and accuracies, the
    test set's, the parameters and the summary."""
    torch.manual_seed(42)
    features, labels, adj_mat = synthetic_cora()
    idx = torch.randperm(len(labels))
    idx_test, idx_val, idx_train = idx[:20], idx[20:30], idx[30:]
    model = GCN(features.shape[1], 16, labels.max().item() + 1, False, 0.5)
    optimizer = Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    criterion = nn.NLLLoss()
    graph: Any = [((features, adj_mat), labels)]
    first = 0
    if session is not None:
        model, optimizer, graph = session.prepare(model, optimizer, graph)
        first = session.start().epoch
    log: list[tuple] = []
    for epoch in range(first, epochs):
        if epoch == stop_at:
            break
        for input, target in graph:
            train_iter(
                epoch + 1, model, optimizer, criterion, input, target, idx_train, idx_val, log
            )
    loss_test, acc_test = test(model, criterion, (features, adj_mat), labels, idx_test)
    summary = session.finish() if session is not None else None
    return {"log": log, "test": (loss_test, acc_test), "params": flat(model), "summary": summary}


# ------------------------------------------------------------------------- vae
class VAE(nn.Module):
    def __init__(self):
        super().__init__()

        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def synthetic_images(count: int, seed: int) -> TensorDataset:
    """``count`` MNIST-shaped images in [0, 1] (ToTensor's), labels 0-9 in turn, drawn
    from their own generator: the global RNG draws what the script's draws."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 1, 28, 28, generator=generator)
    return TensorDataset(images, torch.arange(count) % 10)


def vae(
    session: Session | None,
    epochs: int = 2,
    batch_size: int = 8,
    images: int = 40,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """main.py on ``images`` synthetic images (a quarter as many for its test set): per
    epoch, train (shuffled batches; every 10th logged), test (its first batch's
    reconstructions compared, no PNG written) and a sample of 64 decoded. Ported: the
    train loader prepared; ``stop_after``: the script stops after that many steps (a
    checkpoint resumes it). Returns each step's loss, each epoch's average loss (as
    printed: the total over the batches this run trained / the data set's size), the
    test losses, the samples, the parameters and the summary."""
    args = SimpleNamespace(batch_size=batch_size, epochs=epochs, seed=1, log_interval=10)
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    kwargs: dict[str, Any] = {}
    train_loader: Any = DataLoader(
        synthetic_images(images, 0), batch_size=args.batch_size, shuffle=True, **kwargs
    )
    test_loader = DataLoader(
        synthetic_images(images // 4, 1), batch_size=args.batch_size, shuffle=False, **kwargs
    )
    model = VAE().to(device)
    optimizer = Adam(model.parameters(), lr=1e-3)
    losses: list[float] = []
    averages: list[float] = []
    test_losses: list[float] = []
    samples: list[torch.Tensor] = []

    def train(epoch):
        model.train()
        train_loss = 0
        for batch_idx, (data, _) in enumerate(train_loader):  # noqa: B007 - logged
            data = data.to(device)
            optimizer.zero_grad()
            recon_batch, mu, logvar = model(data)
            loss = loss_function(recon_batch, data, mu, logvar)
            loss.backward()
            train_loss += loss.item()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == stop_after:
                return False
        averages.append(train_loss / len(train_loader.dataset))
        return True

    def test(epoch):
        model.eval()
        test_loss = 0
        with torch.no_grad():
            for i, (data, _) in enumerate(test_loader):
                data = data.to(device)
                recon_batch, mu, logvar = model(data)
                test_loss += loss_function(recon_batch, data, mu, logvar).item()
                if i == 0:
                    n = min(data.size(0), 8)
                    torch.cat([data[:n], recon_batch.view(args.batch_size, 1, 28, 28)[:n]])
        test_loss /= len(test_loader.dataset)
        test_losses.append(test_loss)

    first = 1
    if session is not None:
        model, optimizer, train_loader = session.prepare(model, optimizer, train_loader)
        first = session.start().epoch + 1
    for epoch in range(first, args.epochs + 1):
        if not train(epoch):
            break
        test(epoch)
        with torch.no_grad():
            sample = torch.randn(64, 20).to(device)
            samples.append(model.decode(sample).cpu())
    summary = session.finish() if session is not None else None
    return {
        "losses": losses,
        "averages": averages,
        "test": test_losses,
        "samples": samples,
        "params": flat(model),
        "keys": list(model.state_dict()),  # what a torch.save(model.state_dict()) holds
        "summary": summary,
    }


# ------------------------------------------------------------- siamese_network
class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock."""

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class TinyResNet(nn.Module):
    """torchvision's ``resnet18(weights=None)`` in its layout (conv1, bn1, relu, maxpool,
    layer1-4, avgpool, fc: the children the script keeps or drops), one block a stage
    and narrow stages after the 64-wide stem: torchvision is not installed here, and a
    resnet18's 11M parameters would take seconds a step."""

    def __init__(self, widths=(16, 16, 16, 16), num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = 64
        for i, width in enumerate(widths):
            setattr(self, f"layer{i + 1}", BasicBlock(inplanes, width, 1 if i == 0 else 2))
            inplanes = width
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(weights=None):
    return TinyResNet()


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        # get resnet model
        self.resnet = resnet18(weights=None)

        # over-write the first conv layer to be able to read MNIST images
        self.resnet.conv1 = nn.Conv2d(
            1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
        )
        self.fc_in_features = self.resnet.fc.in_features

        # remove the last layer of resnet18 (linear layer which is before avgpool layer)
        self.resnet = torch.nn.Sequential(*(list(self.resnet.children())[:-1]))

        # add linear layers to compare between the features of the two images
        self.fc = nn.Sequential(
            nn.Linear(self.fc_in_features * 2, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, 1),
        )

        self.sigmoid = nn.Sigmoid()

        # initialize the weights
        self.resnet.apply(self.init_weights)
        self.fc.apply(self.init_weights)

    def init_weights(self, m):
        if isinstance(m, nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            m.bias.data.fill_(0.01)

    def forward_once(self, x):
        output = self.resnet(x)
        output = output.view(output.size()[0], -1)
        return output

    def forward(self, input1, input2):
        output1 = self.forward_once(input1)
        output2 = self.forward_once(input2)
        output = torch.cat((output1, output2), 1)
        output = self.fc(output)
        output = self.sigmoid(output)
        return output


class APP_MATCHER(Dataset):  # noqa: N801 - the script's name
    def __init__(self, root, train, download=False):
        super().__init__()
        # MNIST's images (uint8, N x 28 x 28) and targets: synthetic, every class twice at least
        count = 40 if train else 20
        generator = torch.Generator().manual_seed(int(train))
        self.dataset = SimpleNamespace(
            data=torch.randint(0, 256, (count, 28, 28), dtype=torch.uint8, generator=generator),
            targets=torch.arange(count) % 10,
        )
        self.data = self.dataset.data.unsqueeze(1).clone()
        self.group_examples()

    def group_examples(self):
        np_arr = np.array(self.dataset.targets.clone(), dtype=None, copy=None)
        self.grouped_examples = {}
        for i in range(0, 10):
            self.grouped_examples[i] = np.where(np_arr == i)[0]

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, index):
        # pick some random class for the first image
        selected_class = random.randint(0, 9)
        random_index_1 = random.randint(0, self.grouped_examples[selected_class].shape[0] - 1)
        index_1 = self.grouped_examples[selected_class][random_index_1]
        image_1 = self.data[index_1].clone().float()
        # same class
        if index % 2 == 0:
            random_index_2 = random.randint(0, self.grouped_examples[selected_class].shape[0] - 1)
            while random_index_2 == random_index_1:
                random_index_2 = random.randint(
                    0, self.grouped_examples[selected_class].shape[0] - 1
                )
            index_2 = self.grouped_examples[selected_class][random_index_2]
            image_2 = self.data[index_2].clone().float()
            target = torch.tensor(1, dtype=torch.float)
        # different class
        else:
            other_selected_class = random.randint(0, 9)
            while other_selected_class == selected_class:
                other_selected_class = random.randint(0, 9)
            random_index_2 = random.randint(
                0, self.grouped_examples[other_selected_class].shape[0] - 1
            )
            index_2 = self.grouped_examples[other_selected_class][random_index_2]
            image_2 = self.data[index_2].clone().float()
            target = torch.tensor(0, dtype=torch.float)
        return image_1, image_2, target


def siamese_network(
    session: Session | None,
    epochs: int = 2,
    batch_size: int = 8,
    accel: bool = False,
    register_scheduler: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """main.py on `APP_MATCHER`'s synthetic MNIST (40 training images, 20 test), its
    test batch the whole test set. ``accel``: the loaders as main.py makes them with an
    accelerator (shuffled, one worker; pinned where there is a GPU), else as on a CPU
    (in order, no worker: the pairs are drawn on the main process). main.py never seeds
    ``random``: its pairs differ from run to run; here it is seeded, to compare. Ported:
    the train loader prepared, the StepLR given to `Session.start` (``register_scheduler``);
    ``stop_after``: the script stops after that many steps (a checkpoint resumes it).
    Returns each step's loss, each epoch's test loss and accuracy, the learning rates,
    the parameters, the buffers and the summary."""
    args = SimpleNamespace(
        batch_size=batch_size,
        test_batch_size=20,
        epochs=epochs,
        lr=1.0,
        gamma=0.7,
        dry_run=False,
        seed=1,
        log_interval=10,
    )
    random.seed(0)
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    train_kwargs: dict[str, Any] = {"batch_size": args.batch_size}
    test_kwargs: dict[str, Any] = {"batch_size": args.test_batch_size}
    if accel:
        accel_kwargs = {
            "num_workers": 1,
            "pin_memory": torch.cuda.is_available(),
            "shuffle": True,
        }
        train_kwargs.update(accel_kwargs)
        test_kwargs.update(accel_kwargs)
    train_dataset = APP_MATCHER("../data", train=True, download=True)
    test_dataset = APP_MATCHER("../data", train=False)
    train_loader: Any = DataLoader(train_dataset, **train_kwargs)
    test_loader = DataLoader(test_dataset, **test_kwargs)
    model = SiameseNetwork().to(device)
    optimizer = Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    losses: list[float] = []
    tests: list[tuple[float, int]] = []

    def train(args, model, device, train_loader, optimizer, epoch):
        model.train()
        criterion = nn.BCELoss()
        for batch_idx, (images_1, images_2, targets) in enumerate(train_loader):  # noqa: B007
            images_1, images_2 = images_1.to(device), images_2.to(device)
            targets = targets.to(device)
            optimizer.zero_grad()
            outputs = model(images_1, images_2).squeeze()
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == stop_after:
                return False
        return True

    def test(model, device, test_loader):
        model.eval()
        test_loss = 0
        correct = 0
        criterion = nn.BCELoss()
        with torch.no_grad():
            for images_1, images_2, targets in test_loader:
                images_1, images_2 = images_1.to(device), images_2.to(device)
                targets = targets.to(device)
                outputs = model(images_1, images_2).squeeze()
                test_loss += criterion(outputs, targets).sum().item()  # sum up batch loss
                pred = torch.where(outputs > 0.5, 1, 0)
                correct += pred.eq(targets.view_as(pred)).sum().item()
        test_loss /= len(test_loader.dataset)
        tests.append((test_loss, correct))

    first = 1
    if session is not None:
        model, optimizer, train_loader = session.prepare(model, optimizer, train_loader)
        first = session.start(**({"scheduler": scheduler} if register_scheduler else {})).epoch + 1
    lrs = []
    for epoch in range(first, args.epochs + 1):
        if not train(args, model, device, train_loader, optimizer, epoch):
            break
        test(model, device, test_loader)
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    summary = session.finish() if session is not None else None
    module = getattr(model, "module", model)
    return {
        "losses": losses,
        "test": tests,
        "lrs": lrs,
        "params": flat(model),
        "buffers": torch.cat([b.reshape(-1).double() for b in module.buffers()]),
        "summary": summary,
    }


# ------------------------------------------------------------------- two ranks
def on_two_ranks(program: str, ways: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """In one 2-rank group, run ``program`` (a function of this module) once per way:
    ``plain`` (ported, the flat all-reduce) or ``ddp_overlap``. Returns each way's
    results, the session's notes, the flat all-reduce's calls and ddp_overlap's summary."""
    init_world("cpu", "gloo")
    results = {}
    try:
        for way in ways:
            chosen = [get_optimization("ddp_overlap")(1.0)] if way == "ddp_overlap" else []
            session = Session(chosen, device="cpu")
            results[way] = globals()[program](session, **kwargs)
            summary = results[way].pop("summary")
            results[way]["notes"] = summary.get("notes", [])
            results[way]["all_reduces"] = summary.get("grad_sync", {}).get("calls")
            results[way]["ddp_overlap"] = summary["optimizations"].get("ddp_overlap")
        return results
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ airbench94
# KellerJordan/cifar10-airbench's airbench94.py (the uncompiled variant), its
# hyperparameters for a tiny run: 64 synthetic images, widths 4/16/16, batch 16,
# 3.5 epochs, the lookahead EMA from epoch 1 every 2 steps, float32 on the CPU.
hyp = {
    "opt": {
        "train_epochs": 3.5,
        "batch_size": 16,
        "lr": 11.5,  # learning rate per 1024 examples
        "momentum": 0.85,
        "weight_decay": 0.0153,  # weight decay per 1024 examples (decoupled from learning rate)
        "bias_scaler": 64.0,  # scales up learning rate (but not weight decay) for BatchNorm biases
        "label_smoothing": 0.2,
        "ema": {"start_epochs": 1, "decay_base": 0.95, "decay_pow": 3.0, "every_n_steps": 2},
        "whiten_bias_epochs": 1,  # how many epochs to train the whitening layer bias
    },
    "aug": {"flip": True, "translate": 2},
    "net": {
        "whitening": {"kernel_size": 2},
        "batchnorm_momentum": 0.6,
        "base_width": 4,
        "scaling_factor": 1 / 9,
        "tta_level": 2,  # test-time augmentation: 0=none, 1=mirror, 2=mirror+translate
    },
}

CIFAR_MEAN = torch.tensor((0.4914, 0.4822, 0.4465))
CIFAR_STD = torch.tensor((0.2470, 0.2435, 0.2616))


class Normalize:
    """torchvision's ``T.Normalize`` on a tensor (torchvision is not installed here)."""

    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, tensor):
        mean = self.mean.to(tensor.dtype).view(-1, 1, 1)
        std = self.std.to(tensor.dtype).view(-1, 1, 1)
        return tensor.sub(mean).div_(std)


def batch_flip_lr(inputs):
    flip_mask = (torch.rand(len(inputs), device=inputs.device) < 0.5).view(-1, 1, 1, 1)
    return torch.where(flip_mask, inputs.flip(-1), inputs)


def batch_crop(images, crop_size):
    r = (images.size(-1) - crop_size) // 2
    shifts = torch.randint(-r, r + 1, size=(len(images), 2), device=images.device)
    images_out = torch.empty(
        (len(images), 3, crop_size, crop_size), device=images.device, dtype=images.dtype
    )
    # The two cropping methods in this if-else produce equivalent results, but the second
    # is faster for r > 2.
    if r <= 2:
        for sy in range(-r, r + 1):
            for sx in range(-r, r + 1):
                mask = (shifts[:, 0] == sy) & (shifts[:, 1] == sx)
                images_out[mask] = images[
                    mask, :, r + sy : r + sy + crop_size, r + sx : r + sx + crop_size
                ]
    else:
        images_tmp = torch.empty(
            (len(images), 3, crop_size, crop_size + 2 * r),
            device=images.device,
            dtype=images.dtype,
        )
        for s in range(-r, r + 1):
            mask = shifts[:, 0] == s
            images_tmp[mask] = images[mask, :, r + s : r + s + crop_size, :]
        for s in range(-r, r + 1):
            mask = shifts[:, 1] == s
            images_out[mask] = images_tmp[mask, :, :, r + s : r + s + crop_size]
    return images_out


class CifarLoader:
    def __init__(self, path, train=True, batch_size=500, aug=None, drop_last=None, shuffle=None):
        # CIFAR-10's uint8 images (N x 32 x 32 x 3) and labels: synthetic, from their own
        # generator (the script loads them from a file), 64 to train, 32 to test
        generator = torch.Generator().manual_seed(int(train))
        count = 64 if train else 32
        data = {
            "images": torch.randint(
                0, 256, (count, 32, 32, 3), dtype=torch.uint8, generator=generator
            ),
            "labels": torch.randint(0, 10, (count,), generator=generator),
            "classes": [str(c) for c in range(10)],
        }
        self.images, self.labels, self.classes = data["images"], data["labels"], data["classes"]
        # It's faster to load+process uint8 data than to load preprocessed fp16 data
        self.images = (
            (self.images.float() / 255).permute(0, 3, 1, 2).to(memory_format=torch.channels_last)
        )

        self.normalize = Normalize(CIFAR_MEAN, CIFAR_STD)
        self.proc_images = {}  # Saved results of image processing to be done on the first epoch
        self.epoch = 0

        self.aug = aug or {}
        for k in self.aug.keys():
            assert k in ["flip", "translate"], "Unrecognized key: %s" % k  # noqa: UP031 - as written

        self.batch_size = batch_size
        self.drop_last = train if drop_last is None else drop_last
        self.shuffle = train if shuffle is None else shuffle

    def __len__(self):
        if self.drop_last:
            return len(self.images) // self.batch_size
        return ceil(len(self.images) / self.batch_size)

    def __iter__(self):
        if self.epoch == 0:
            images = self.proc_images["norm"] = self.normalize(self.images)
            # Pre-flip images in order to do every-other epoch flipping scheme
            if self.aug.get("flip", False):
                images = self.proc_images["flip"] = batch_flip_lr(images)
            # Pre-pad images to save time when doing random translation
            pad = self.aug.get("translate", 0)
            if pad > 0:
                self.proc_images["pad"] = F.pad(images, (pad,) * 4, "reflect")

        if self.aug.get("translate", 0) > 0:
            images = batch_crop(self.proc_images["pad"], self.images.shape[-2])
        elif self.aug.get("flip", False):
            images = self.proc_images["flip"]
        else:
            images = self.proc_images["norm"]
        # Flip all images together every other epoch. This increases diversity relative to
        # random flipping
        if self.aug.get("flip", False):
            if self.epoch % 2 == 1:
                images = images.flip(-1)

        self.epoch += 1

        indices = (torch.randperm if self.shuffle else torch.arange)(
            len(images), device=images.device
        )
        for i in range(len(self)):
            idxs = indices[i * self.batch_size : (i + 1) * self.batch_size]
            yield (images[idxs], self.labels[idxs])


class StatefulCifarLoader(CifarLoader):
    """A port's CifarLoader with what it keeps from epoch to epoch checkpointed (its
    epoch count: every other epoch flipped; the images flipped and padded once)."""

    def state_dict(self):
        return {"epoch": self.epoch, "proc_images": dict(self.proc_images)}

    def load_state_dict(self, state):
        self.epoch, self.proc_images = state["epoch"], dict(state["proc_images"])


class Flatten(nn.Module):
    def forward(self, x):
        return x.view(x.size(0), -1)


class Mul(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


class BatchNorm(nn.BatchNorm2d):
    def __init__(
        self,
        num_features,
        eps=1e-12,
        momentum=hyp["net"]["batchnorm_momentum"],
        weight=False,
        bias=True,
    ):
        super().__init__(num_features, eps=eps, momentum=1 - momentum)
        self.weight.requires_grad = weight
        self.bias.requires_grad = bias
        # Note that PyTorch already initializes the weights to one and bias to zero


class Conv(nn.Conv2d):
    def __init__(self, in_channels, out_channels, kernel_size=3, padding="same", bias=False):
        super().__init__(
            in_channels, out_channels, kernel_size=kernel_size, padding=padding, bias=bias
        )

    def reset_parameters(self):
        super().reset_parameters()
        if self.bias is not None:
            self.bias.data.zero_()
        # Create an implicit residual via identity initialization
        w = self.weight.data
        torch.nn.init.dirac_(w[: w.size(1)])


class ConvGroup(nn.Module):
    def __init__(self, channels_in, channels_out):
        super().__init__()
        self.conv1 = Conv(channels_in, channels_out)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = BatchNorm(channels_out)
        self.conv2 = Conv(channels_out, channels_out)
        self.norm2 = BatchNorm(channels_out)
        self.activ = nn.GELU()

    def forward(self, x):
        x = self.conv1(x)
        x = self.pool(x)
        x = self.norm1(x)
        x = self.activ(x)
        x = self.conv2(x)
        x = self.norm2(x)
        x = self.activ(x)
        return x


def make_net():
    widths = {
        "block1": (1 * hyp["net"]["base_width"]),
        "block2": (4 * hyp["net"]["base_width"]),
        "block3": (4 * hyp["net"]["base_width"]),
    }
    whiten_conv_width = 2 * 3 * hyp["net"]["whitening"]["kernel_size"] ** 2
    net = nn.Sequential(
        Conv(
            3,
            whiten_conv_width,
            kernel_size=hyp["net"]["whitening"]["kernel_size"],
            padding=0,
            bias=True,
        ),
        nn.GELU(),
        ConvGroup(whiten_conv_width, widths["block1"]),
        ConvGroup(widths["block1"], widths["block2"]),
        ConvGroup(widths["block2"], widths["block3"]),
        nn.MaxPool2d(3),
        Flatten(),
        nn.Linear(widths["block3"], 10, bias=False),
        Mul(hyp["net"]["scaling_factor"]),
    )
    net[0].weight.requires_grad = False
    net = net.to(memory_format=torch.channels_last)  # float32 on the CPU: no .half().cuda()
    for mod in net.modules():
        if isinstance(mod, BatchNorm):
            mod.float()
    return net


def get_patches(x, patch_shape):
    c, (h, w) = x.shape[1], patch_shape
    return x.unfold(2, h, 1).unfold(3, w, 1).transpose(1, 3).reshape(-1, c, h, w).float()


def get_whitening_parameters(patches):
    n, c, h, w = patches.shape
    patches_flat = patches.view(n, -1)
    est_patch_covariance = (patches_flat.T @ patches_flat) / n
    eigenvalues, eigenvectors = torch.linalg.eigh(est_patch_covariance, UPLO="U")
    return eigenvalues.flip(0).view(-1, 1, 1, 1), eigenvectors.T.reshape(c * h * w, c, h, w).flip(0)


def init_whitening_conv(layer, train_set, eps=5e-4):
    patches = get_patches(train_set, patch_shape=layer.weight.data.shape[2:])
    eigenvalues, eigenvectors = get_whitening_parameters(patches)
    eigenvectors_scaled = eigenvectors / torch.sqrt(eigenvalues + eps)
    layer.weight.data[:] = torch.cat((eigenvectors_scaled, -eigenvectors_scaled))


class LookaheadState:
    def __init__(self, net):
        self.net_ema = {k: v.clone() for k, v in net.state_dict().items()}

    def update(self, net, decay):
        for ema_param, net_param in zip(
            self.net_ema.values(), net.state_dict().values(), strict=True
        ):
            if net_param.dtype in (torch.half, torch.float):
                ema_param.lerp_(net_param, 1 - decay)
                # Copy the ema parameters back to the network, similarly to the Lookahead
                # optimizer
                net_param.copy_(ema_param)


def airbench94(
    session: Session | None,
    register_lookahead: bool = True,
    loader_state: bool = False,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """airbench94.py's main() (one run, its printing left out) on `CifarLoader`'s
    synthetic images, seeded (the script is not). Ported: the train loader (a
    CifarLoader) prepared, the LambdaLR and ``current_steps`` given to
    `Session.start`, the lookahead's EMA too (``register_lookahead``: as a function
    returning its tensors, None until the lookahead starts); ``stop_after``: the script
    stops after that many steps (a checkpoint resumes it). Returns each step's loss,
    each epoch's validation loss and accuracy, the TTA accuracy, the parameters, the
    buffers, the lookahead's tensors and the summary."""
    torch.manual_seed(0)
    batch_size = hyp["opt"]["batch_size"]
    epochs = hyp["opt"]["train_epochs"]
    momentum = hyp["opt"]["momentum"]
    kilostep_scale = 1024 * (1 + 1 / (1 - momentum))
    lr = hyp["opt"]["lr"] / kilostep_scale  # un-decoupled learning rate for PyTorch SGD
    wd = hyp["opt"]["weight_decay"] * batch_size / kilostep_scale
    lr_biases = lr * hyp["opt"]["bias_scaler"]

    loss_fn = nn.CrossEntropyLoss(label_smoothing=hyp["opt"]["label_smoothing"], reduction="none")

    train_augs = dict(flip=hyp["aug"]["flip"], translate=hyp["aug"]["translate"])
    Loader = StatefulCifarLoader if loader_state else CifarLoader  # noqa: N806
    train_loader: Any = Loader("cifar10", train=True, batch_size=batch_size, aug=train_augs)
    test_loader = CifarLoader("cifar10", train=False, batch_size=2000)

    def triangle(steps, start=0, end=0, peak=0.5):
        xp = torch.tensor([0, int(peak * steps), steps])
        fp = torch.tensor([start, 1, end])
        x = torch.arange(1 + steps)
        m = (fp[1:] - fp[:-1]) / (xp[1:] - xp[:-1])
        b = fp[:-1] - (m * xp[:-1])
        indices = torch.sum(torch.ge(x[:, None], xp[None, :]), 1) - 1
        indices = torch.clamp(indices, 0, len(m) - 1)
        return m[indices] * x + b[indices]

    total_train_steps = ceil(len(train_loader) * epochs)
    lr_schedule = triangle(total_train_steps, start=0.2, end=0.07, peak=0.23)

    model = make_net()
    lookahead_state = None
    current_steps = 0

    norm_biases = [p for k, p in model.named_parameters() if "norm" in k and p.requires_grad]
    other_params = [p for k, p in model.named_parameters() if "norm" not in k and p.requires_grad]
    param_configs = [
        dict(params=norm_biases, lr=lr_biases, weight_decay=wd / lr_biases),
        dict(params=other_params, lr=lr, weight_decay=wd / lr),
    ]
    optimizer = torch.optim.SGD(param_configs, momentum=momentum, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_schedule[i])

    # Initialize the whitening layer using training images
    train_images = train_loader.normalize(train_loader.images[:5000])
    init_whitening_conv(model[0], train_images)

    first = 0
    if session is not None:
        model, optimizer, train_loader = session.prepare(model, optimizer, train_loader)
        registered: dict[str, Any] = {"current_steps": lambda: current_steps}
        if register_lookahead:
            registered["lookahead"] = lambda: lookahead_state and lookahead_state.net_ema
        start = session.start(scheduler=scheduler, **registered)
        first, current_steps = start.epoch, start.values["current_steps"]
        if start.values.get("lookahead") is not None:
            lookahead_state = LookaheadState.__new__(LookaheadState)
            lookahead_state.net_ema = start.values["lookahead"]

    losses: list[float] = []
    validation: list[tuple[float, float]] = []
    for epoch in range(first, ceil(epochs)):
        model[0].bias.requires_grad = epoch < hyp["opt"]["whiten_bias_epochs"]

        model.train()
        for inputs, labels in train_loader:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            current_steps += 1
            losses.append(loss.item())

            ema = hyp["opt"]["ema"]
            if epoch >= ema["start_epochs"] and current_steps % ema["every_n_steps"] == 0:
                if lookahead_state is None:
                    lookahead_state = LookaheadState(model)
                else:
                    # We warm up our ema's decay/momentum value over training
                    base_rho = ema["decay_base"] ** ema["every_n_steps"]
                    rho = base_rho * (current_steps / total_train_steps) ** ema["decay_pow"]
                    lookahead_state.update(model, decay=rho)

            if current_steps >= total_train_steps or current_steps == stop_after:
                break
        if current_steps == stop_after:
            break

        if lookahead_state is not None:
            # Copy back parameters a final time after each epoch
            lookahead_state.update(model, decay=1.0)

        model.eval()
        with torch.no_grad():
            loss_list, acc_list = [], []
            for inputs, labels in test_loader:
                outputs = model(inputs)
                loss_list.append(loss_fn(outputs, labels).float().mean())
                acc_list.append((outputs.argmax(1) == labels).float().mean())
            val_acc = torch.stack(acc_list).mean().item()
            val_loss = torch.stack(loss_list).mean().item()
        validation.append((val_loss, val_acc))

    tta_val_acc = None
    if current_steps != stop_after:
        with torch.no_grad():
            test_images = test_loader.normalize(test_loader.images)
            test_labels = test_loader.labels

            def infer_mirror(inputs, net):
                return 0.5 * net(inputs) + 0.5 * net(inputs.flip(-1))

            def infer_mirror_translate(inputs, net):
                logits = infer_mirror(inputs, net)
                pad = 1
                padded_inputs = F.pad(inputs, (pad,) * 4, "reflect")
                inputs_translate_list = [
                    padded_inputs[:, :, 0:32, 0:32],
                    padded_inputs[:, :, 2:34, 2:34],
                ]
                logits_translate_list = [
                    infer_mirror(inputs_translate, net)
                    for inputs_translate in inputs_translate_list
                ]
                logits_translate = torch.stack(logits_translate_list).mean(0)
                return 0.5 * logits + 0.5 * logits_translate

            model.eval()
            logits_tta = torch.cat(
                [infer_mirror_translate(inputs, model) for inputs in test_images.split(2000)]
            )
            tta_val_acc = (logits_tta.argmax(1) == test_labels).float().mean().item()

    summary = session.finish() if session is not None else None
    module = getattr(model, "module", model)
    return {
        "losses": losses,
        "validation": validation,
        "tta": tta_val_acc,
        "params": flat(model),
        "buffers": torch.cat([b.reshape(-1).double() for b in module.buffers()]),
        "lookahead": None if lookahead_state is None else dict(lookahead_state.net_ema),
        "summary": summary,
    }


# ------------------------------------------------------------------------- dqn
# pytorch/tutorials' intermediate_source/reinforcement_q_learning.py (DQN on
# CartPole-v1): gymnasium is not installed, so `CartPole` is its CartPoleEnv (the
# physics, the TimeLimit of 500 steps, seeded generators of its own) in a few lines.
class Discrete:
    """gymnasium's ``spaces.Discrete(n)``: ``sample()`` draws from its own generator."""

    def __init__(self, n):
        self.n = n
        self.np_random = np.random.default_rng()

    def seed(self, seed):
        self.np_random = np.random.default_rng(seed)

    def sample(self):
        return int(self.np_random.integers(self.n))


class CartPole:
    """gymnasium's ``CartPole-v1`` (CartPoleEnv under a TimeLimit): euler steps, reward
    1 a step, terminated past 2.4 units or 12 degrees, truncated after
    ``max_episode_steps``; ``reset()`` draws the start from the env's own generator."""

    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    theta_threshold_radians, x_threshold = 12 * 2 * math.pi / 360, 2.4

    def __init__(self, max_episode_steps=500):
        self.total_mass = self.masspole + self.masscart
        self.polemass_length = self.masspole * self.length
        self.action_space = Discrete(2)
        self.observation_space = SimpleNamespace(seed=lambda seed: None)
        self.np_random = np.random.default_rng()
        self.max_episode_steps = max_episode_steps
        self.state, self.elapsed_steps = None, 0

    def reset(self, seed=None):
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
        self.state = self.np_random.uniform(low=-0.05, high=0.05, size=(4,))
        self.elapsed_steps = 0
        return np.array(self.state, dtype=np.float32), {}

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        costheta, sintheta = math.cos(theta), math.sin(theta)
        temp = (force + self.polemass_length * theta_dot**2 * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta**2 / self.total_mass)
        )
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * xacc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * thetaacc
        self.state = (x, x_dot, theta, theta_dot)
        terminated = bool(
            x < -self.x_threshold
            or x > self.x_threshold
            or theta < -self.theta_threshold_radians
            or theta > self.theta_threshold_radians
        )
        self.elapsed_steps += 1
        truncated = self.elapsed_steps >= self.max_episode_steps
        return np.array(self.state, dtype=np.float32), 1.0, terminated, truncated, {}


Transition = namedtuple("Transition", ("state", "action", "next_state", "reward"))


class ReplayMemory:
    def __init__(self, capacity):
        self.memory = deque([], maxlen=capacity)

    def push(self, *args):
        """Save a transition"""
        self.memory.append(Transition(*args))

    def sample(self, batch_size):
        return random.sample(self.memory, batch_size)

    def __len__(self):
        return len(self.memory)


class DQN(nn.Module):
    def __init__(self, n_observations, n_actions, hidden=128):
        super().__init__()
        self.layer1 = nn.Linear(n_observations, hidden)
        self.layer2 = nn.Linear(hidden, hidden)
        self.layer3 = nn.Linear(hidden, n_actions)

    # Called with either one element to determine next action, or a batch
    # during optimization. Returns tensor([[left0exp,right0exp]...]).
    def forward(self, x):
        x = F.relu(self.layer1(x))
        x = F.relu(self.layer2(x))
        return self.layer3(x)


def env_state(env: CartPole) -> dict[str, Any]:
    """What the env carries from step to step (gymnasium's has no state_dict): its
    physics, its step count and both generators' states."""
    return {
        "state": None if env.state is None else tuple(float(v) for v in env.state),
        "elapsed_steps": env.elapsed_steps,
        "np_random": env.np_random.bit_generator.state,
        "action_space": env.action_space.np_random.bit_generator.state,
    }


def load_env_state(env: CartPole, saved: dict[str, Any]) -> None:
    env.state, env.elapsed_steps = saved["state"], saved["elapsed_steps"]
    env.np_random.bit_generator.state = saved["np_random"]
    env.action_space.np_random.bit_generator.state = saved["action_space"]


def dqn(
    session: Session | None,
    num_episodes: int = 8,
    batch_size: int = 16,
    hidden: int = 16,
    capacity: int = 100,
    max_episode_steps: int = 50,
    register: tuple[str, ...] = ("target_net", "memory", "steps_done", "env"),
    stop_after: int | None = None,
) -> dict[str, Any]:
    """The tutorial's training loop, its hyperparameters but for the sizes (BATCH_SIZE
    ``batch_size`` for 128, ``hidden`` units for 128, a memory of ``capacity`` for
    10000, episodes truncated at ``max_episode_steps`` for 500): each env step an
    epsilon-greedy action (``steps_done``, global), a transition pushed to the replay
    memory (a deque), ``optimize_model()`` (a batch ``random.sample``d from it: it
    returns early while the memory holds fewer than BATCH_SIZE), a soft update of the
    target net. Seeded as the tutorial seeds (random, torch, the env's reset and its
    action space). Ported: the prepared loader is ``range(max_episode_steps)``, for
    ``count()``: an episode is an epoch, an env step a step; ``register`` names what
    is given to `Session.start` (the script's state outside the model: ``env`` is its
    physics and generators, ``memory`` its transitions, as plain values taken back
    from ``start.values``); a resume mid-episode goes on with the env's state, not a
    reset. ``stop_after``: the script stops after that many env steps. Returns each
    update's loss, each episode's duration, the policy and target parameters and the
    summary."""
    BATCH_SIZE = batch_size  # noqa: N806 - the tutorial's names
    GAMMA = 0.99  # noqa: N806
    EPS_START = 0.9  # noqa: N806
    EPS_END = 0.05  # noqa: N806
    EPS_DECAY = 1000  # noqa: N806
    TAU = 0.005  # noqa: N806
    LR = 1e-4  # noqa: N806
    device = torch.device("cpu")
    env = CartPole(max_episode_steps)
    seed = 42
    random.seed(seed)
    torch.manual_seed(seed)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    env.observation_space.seed(seed)

    # Get number of actions from gym action space
    n_actions = env.action_space.n
    # Get the number of state observations
    state, info = env.reset()
    n_observations = len(state)

    policy_net = DQN(n_observations, n_actions, hidden).to(device)
    target_net = DQN(n_observations, n_actions, hidden).to(device)
    target_net.load_state_dict(policy_net.state_dict())

    optimizer = torch.optim.AdamW(policy_net.parameters(), lr=LR, amsgrad=True)
    memory = ReplayMemory(capacity)

    steps_done = 0

    def select_action(state):
        nonlocal steps_done
        sample = random.random()
        eps_threshold = EPS_END + (EPS_START - EPS_END) * math.exp(-1.0 * steps_done / EPS_DECAY)
        steps_done += 1
        if sample > eps_threshold:
            with torch.no_grad():
                # t.max(1) will return the largest column value of each row.
                # second column on max result is index of where max element was
                # found, so we pick action with the larger expected reward.
                return policy_net(state).max(1).indices.view(1, 1)
        else:
            return torch.tensor([[env.action_space.sample()]], device=device, dtype=torch.long)

    episode_durations: list[int] = []
    losses: list[float] = []

    def optimize_model():
        if len(memory) < BATCH_SIZE:
            return
        transitions = memory.sample(BATCH_SIZE)
        # Transpose the batch: a Transition of batch-arrays.
        batch = Transition(*zip(*transitions, strict=True))

        # Compute a mask of non-final states and concatenate the batch elements
        non_final_mask = torch.tensor(
            tuple(map(lambda s: s is not None, batch.next_state)),
            device=device,
            dtype=torch.bool,
        )
        non_final_next_states = torch.cat([s for s in batch.next_state if s is not None])
        state_batch = torch.cat(batch.state)
        action_batch = torch.cat(batch.action)
        reward_batch = torch.cat(batch.reward)

        # Q(s_t, a): the columns of the actions taken
        state_action_values = policy_net(state_batch).gather(1, action_batch)

        # V(s_{t+1}) for all next states, by the "older" target_net; 0 for final states
        next_state_values = torch.zeros(BATCH_SIZE, device=device)
        with torch.no_grad():
            next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values
        # Compute the expected Q values
        expected_state_action_values = (next_state_values * GAMMA) + reward_batch

        # Compute Huber loss
        criterion = nn.SmoothL1Loss()
        loss = criterion(state_action_values, expected_state_action_values.unsqueeze(1))

        # Optimize the model
        optimizer.zero_grad()
        loss.backward()
        # In-place gradient clipping
        torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
        optimizer.step()
        losses.append(loss.item())

    steps: Any = None  # count(): the env steps of an episode
    first, resumed = 0, False
    if session is not None:
        policy_net, optimizer, steps = session.prepare(
            policy_net, optimizer, range(max_episode_steps)
        )
        getters: dict[str, Any] = {
            "target_net": target_net,
            "memory": lambda: list(memory.memory),
            "steps_done": lambda: steps_done,
            "env": lambda: {**env_state(env), "observation": state},
            "episode_durations": lambda: episode_durations,
        }
        start = session.start(**{name: getters[name] for name in (*register, "episode_durations")})
        first, resumed = start.epoch, start.resumed_from is not None
        values = start.values
        if resumed:
            episode_durations = list(values["episode_durations"])
            if "memory" in register:
                memory.memory.extend(values["memory"])
            if "steps_done" in register:
                steps_done = values["steps_done"]
            if "env" in register:
                load_env_state(env, values["env"])
                state = values["env"]["observation"]
    env_steps = 0
    for i_episode in range(first, num_episodes):  # noqa: B007 - the tutorial's loop
        if resumed and "env" in register:  # the episode the checkpoint was taken in
            resumed = False
        else:
            # Initialize the environment and get its state
            state, info = env.reset()
            state = torch.tensor(state, dtype=torch.float32, device=device).unsqueeze(0)
        for t in steps if steps is not None else count():
            action = select_action(state)
            observation, reward, terminated, truncated, _ = env.step(action.item())
            reward = torch.tensor([reward], device=device)
            done = terminated or truncated

            if terminated:
                next_state = None
            else:
                next_state = torch.tensor(
                    observation, dtype=torch.float32, device=device
                ).unsqueeze(0)

            # Store the transition in memory
            memory.push(state, action, next_state, reward)

            # Move to the next state
            state = next_state

            # Perform one step of the optimization (on the policy network)
            optimize_model()

            # Soft update of the target network's weights
            # θ′ ← τ θ + (1 −τ )θ′
            target_net_state_dict = target_net.state_dict()
            policy_net_state_dict = policy_net.state_dict()
            for key in policy_net_state_dict:
                target_net_state_dict[key] = policy_net_state_dict[key] * TAU + (
                    target_net_state_dict[key] * (1 - TAU)
                )
            target_net.load_state_dict(target_net_state_dict)

            env_steps += 1
            if done or env_steps == stop_after:
                if done:
                    episode_durations.append(t + 1)
                break
        if env_steps == stop_after:
            break
    summary = session.finish() if session is not None else None
    return {
        "losses": losses,
        "durations": episode_durations,
        "steps_done": steps_done,
        "params": flat(policy_net),
        "target": flat(target_net),
        "summary": summary,
    }


# -------------------------------------------------------------------- makemore
# karpathy/makemore's makemore.py: its Transformer (and Bigram), CharDataset,
# InfiniteDataLoader and training loop, on a synthetic list of names.
@dataclass
class ModelConfig:
    block_size: int = None  # length of the input sequences of integers
    vocab_size: int = None  # the input integers are in range [0 .. vocab_size -1]
    # parameters below control the sizes of each model slightly differently
    n_layer: int = 4
    n_embd: int = 64
    n_embd2: int = 64
    n_head: int = 4


class NewGELU(nn.Module):
    def forward(self, x):
        return (
            0.5
            * x
            * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        # causal mask to ensure that attention is only applied to the left in the input sequence
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, 1, config.block_size, config.block_size
            ),
        )
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 - the script's names
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs
        y = self.c_proj(y)
        return y


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(
            dict(
                c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
                c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
                act=NewGELU(),
            )
        )
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))  # MLP forward

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.block_size = config.block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def get_block_size(self):
        return self.block_size

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0)  # shape (1, t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (1, t, n_embd)
        x = tok_emb + pos_emb
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


class Bigram(nn.Module):
    def __init__(self, config):
        super().__init__()
        n = config.vocab_size
        self.logits = nn.Parameter(torch.zeros((n, n)))

    def get_block_size(self):
        return 1  # this model only needs one previous character to predict the next

    def forward(self, idx, targets=None):
        logits = self.logits[idx]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


@torch.inference_mode()
def evaluate(model, dataset, batch_size=50, max_batches=None):
    model.eval()
    loader = DataLoader(dataset, shuffle=True, batch_size=batch_size, num_workers=0)
    losses = []
    for i, batch in enumerate(loader):
        X, Y = batch  # noqa: N806
        logits, loss = model(X, Y)
        losses.append(loss.item())
        if max_batches is not None and i >= max_batches:
            break
    mean_loss = torch.tensor(losses).mean().item()
    model.train()  # reset model back to training mode
    return mean_loss


class CharDataset(Dataset):
    def __init__(self, words, chars, max_word_length):
        self.words = words
        self.chars = chars
        self.max_word_length = max_word_length
        self.stoi = {ch: i + 1 for i, ch in enumerate(chars)}
        self.itos = {i: s for s, i in self.stoi.items()}  # inverse mapping

    def __len__(self):
        return len(self.words)

    def get_vocab_size(self):
        return len(self.chars) + 1  # all the possible characters and special 0 token

    def get_output_length(self):
        return self.max_word_length + 1  # <START> token followed by words

    def encode(self, word):
        return torch.tensor([self.stoi[w] for w in word], dtype=torch.long)

    def __getitem__(self, idx):
        word = self.words[idx]
        ix = self.encode(word)
        x = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        y = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        x[1 : 1 + len(ix)] = ix
        y[: len(ix)] = ix
        y[len(ix) + 1 :] = -1  # index -1 will mask the loss at the inactive locations
        return x, y


def synthetic_names(count: int = 120, seed: int = 0) -> str:
    """names.txt's shape: ``count`` lowercase names of 2-4 syllables, one per line."""
    rng = random.Random(seed)
    syllables = ["an", "el", "mi", "ra", "jo", "li", "sa", "ke", "ny", "o", "bel", "ta"]
    return "\n".join(
        "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(count)
    )


def create_datasets(data):
    words = data.splitlines()
    words = [w.strip() for w in words]  # get rid of any leading or trailing white space
    words = [w for w in words if w]  # get rid of any empty strings
    chars = sorted(list(set("".join(words))))  # all the possible characters
    max_word_length = max(len(w) for w in words)
    # partition the input data into a training and the test set
    test_set_size = min(1000, int(len(words) * 0.1))  # 10% of the training set, or up to 1000
    rp = torch.randperm(len(words)).tolist()
    train_words = [words[i] for i in rp[:-test_set_size]]
    test_words = [words[i] for i in rp[-test_set_size:]]
    train_dataset = CharDataset(train_words, chars, max_word_length)
    test_dataset = CharDataset(test_words, chars, max_word_length)
    return train_dataset, test_dataset


class InfiniteDataLoader:
    def __init__(self, dataset, prepare=None, **kwargs):
        train_sampler = torch.utils.data.RandomSampler(
            dataset, replacement=True, num_samples=int(1e10)
        )
        self.train_loader = DataLoader(dataset, sampler=train_sampler, **kwargs)
        if prepare is not None:  # ported: the session's loader, before iter() draws its seed
            self.train_loader = prepare(self.train_loader)
        self.data_iter = iter(self.train_loader)

    def next(self):
        try:
            batch = next(self.data_iter)
        except StopIteration:  # this will technically only happen after 1e10 samples
            self.data_iter = iter(self.train_loader)
            batch = next(self.data_iter)
        return batch


def makemore(
    session: Session | None,
    type: str = "transformer",  # the script's --type
    max_steps: int = 16,
    eval_every: int = 6,
    num_workers: int = 0,
    port: str = "inner",
    stop_after: int | None = None,
    work_dir: Any = None,
) -> dict[str, Any]:
    """makemore.py's training on `synthetic_names` (no samples printed), a tiny model,
    batch 8, an evaluation (up to 10 batches of 20) every ``eval_every`` steps instead
    of 500, the best model saved with torch.save(model.state_dict()) in ``work_dir``.
    Ported (``port``): ``inner``: InfiniteDataLoader's DataLoader prepared before its
    ``iter()``, so ``batch_loader.next()`` takes the session's steps; ``after``: prepared
    after it (the script's iterator made, then replaced); ``whole``: the
    InfiniteDataLoader itself given to prepare. ``stop_after``: the script stops after
    that many steps (a checkpoint resumes it). Returns each step's loss, the
    evaluations, the best loss, the parameters and the summary."""
    args = SimpleNamespace(
        type=type,
        n_layer=1,
        n_head=2,
        n_embd=16,
        n_embd2=16,
        batch_size=8,
        learning_rate=5e-4,
        weight_decay=0.01,
        num_workers=num_workers,
        max_steps=max_steps,
        seed=3407,
    )
    torch.manual_seed(args.seed)
    train_dataset, test_dataset = create_datasets(synthetic_names())
    vocab_size = train_dataset.get_vocab_size()
    block_size = train_dataset.get_output_length()
    config = ModelConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        n_embd2=args.n_embd2,
    )
    model = Transformer(config) if args.type == "transformer" else Bigram(config)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        betas=(0.9, 0.99),
        eps=1e-8,
    )

    def prepare(loader):
        nonlocal model, optimizer
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        return loader

    batch_loader = InfiniteDataLoader(
        train_dataset,
        prepare=prepare if session is not None and port == "inner" else None,
        batch_size=args.batch_size,
        pin_memory=True,
        num_workers=args.num_workers,
    )
    best_loss = None
    step = 0
    if session is not None:
        if port == "after":  # its DataLoader prepared after InfiniteDataLoader iterated it
            model, optimizer, loader = session.prepare(model, optimizer, batch_loader.train_loader)
            batch_loader.train_loader, batch_loader.data_iter = loader, iter(loader)
        elif port == "whole":  # the InfiniteDataLoader given to prepare
            model, optimizer, batch_loader = session.prepare(model, optimizer, batch_loader)
        start = session.start(best_loss=lambda: best_loss)
        best_loss, step = start.values["best_loss"], start.step
    losses: list[float] = []
    evaluations: list[tuple[int, float, float]] = []
    while True:
        batch = batch_loader.next()
        X, Y = batch  # noqa: N806
        logits, loss = model(X, Y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

        if step > 0 and step % eval_every == 0:
            with session.paused("evaluation") if session is not None else nullcontext():
                train_loss = evaluate(model, train_dataset, batch_size=20, max_batches=10)
                test_loss = evaluate(model, test_dataset, batch_size=20, max_batches=10)
                evaluations.append((step, train_loss, test_loss))
                if best_loss is None or test_loss < best_loss:
                    if work_dir is not None:
                        torch.save(model.state_dict(), os.path.join(work_dir, "model.pt"))
                    best_loss = test_loss

        step += 1
        if args.max_steps >= 0 and step >= args.max_steps:
            break
        if step == stop_after:
            break
    summary = session.finish() if session is not None else None
    return {
        "losses": losses,
        "evaluations": evaluations,
        "best_loss": best_loss,
        "params": flat(model),
        "summary": summary,
    }


# ---------------------------------------------------------------------- llm.c
# karpathy/llm.c's train_gpt2.py: its GPT-2 (tied embeddings, init from its own
# generator), its DistributedDataLoader over .bin shards, gradient accumulation with
# ``model.require_backward_grad_sync``, AdamW or ``--zero_stage 1``'s
# ZeroRedundancyOptimizer, a cosine lr set by hand each step, clip_grad_norm_ and a
# val loss every few steps; a tiny GPT, float32 on the CPU.
@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class GPTSelfAttention(nn.Module):  # llm.c's CausalSelfAttention (FLASH = 0)
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.LLMC_RESIDUAL_SCALE_FLAG = 1
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, 1, config.block_size, config.block_size
            ),
        )

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 - the script's names
        qkv = self.c_attn(x)
        q, k, v = qkv.split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = NewGELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.LLMC_RESIDUAL_SCALE_FLAG = 1

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = GPTSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = GPTMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.LLMC_SKIP_INIT = 1  # don't init this one, we will tie weights
        self.transformer.wte.weight = self.lm_head.weight
        self.init_rng = torch.Generator()
        self.init_rng.manual_seed(42)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = (
                0.02
                if not hasattr(module, "LLMC_RESIDUAL_SCALE_FLAG")
                else 0.02 / math.sqrt(2 * self.config.n_layer)
            )
            if not hasattr(module, "LLMC_SKIP_INIT"):
                torch.nn.init.normal_(module.weight, mean=0.0, std=std, generator=self.init_rng)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=self.init_rng)

    def forward(self, idx, targets=None, return_logits=True):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        if not return_logits:
            logits = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, zero_stage):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        use_fused = device_type == "cuda"
        if zero_stage == 1:
            optimizer = ZeroRedundancyOptimizer(
                **optim_groups[0],
                optimizer_class=torch.optim.AdamW,
                lr=learning_rate,
                betas=betas,
                fused=use_fused,
            )
            optimizer.add_param_group(optim_groups[1])
        else:
            optimizer = torch.optim.AdamW(
                optim_groups, lr=learning_rate, betas=betas, fused=use_fused
            )
        return optimizer


def write_llmc_shard(filename, tokens) -> None:
    """A .bin shard as llm.c's data scripts write it: a header of 256 int32 (magic
    20240520, version 1, the token count), then the tokens as uint16."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def synthetic_llmc_shards(folder, vocab_size: int = 64, train: int = 2, tokens: int = 100) -> None:
    """``train`` training shards and one validation shard of ``tokens`` random tokens
    each, drawn from their own generator, in ``folder``."""
    rng = np.random.default_rng(0)
    for i in range(train):
        write_llmc_shard(
            os.path.join(folder, f"train_{i:06d}.bin"), rng.integers(0, vocab_size, tokens)
        )
    write_llmc_shard(os.path.join(folder, "val_000000.bin"), rng.integers(0, vocab_size, tokens))


def _peek_data_shard(filename):
    with open(filename, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    return header[2]


def _load_data_shard(filename):
    with open(filename, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        assert header[0] == 20240520, "magic number mismatch in the data .bin file"
        assert header[1] == 1, "unsupported version"
        ntok = header[2]
        tokens = np.frombuffer(f.read(), dtype=np.uint16)
    assert len(tokens) == ntok, "number of tokens read does not match header?"
    return tokens


class DistributedDataLoader:
    def __init__(self, filename_pattern, B, T, process_rank, num_processes):  # noqa: N803
        self.process_rank = process_rank
        self.num_processes = num_processes
        self.B = B
        self.T = T
        self.files = sorted(glob.glob(filename_pattern))
        assert len(self.files) > 0
        ntok_total = 0
        for fname in self.files:
            shard_ntok = _peek_data_shard(fname)
            assert shard_ntok >= num_processes * B * T + 1
            ntok_total += shard_ntok
        self.ntok_total = ntok_total
        self.current_shard = None
        self.reset()

    def reset(self):
        if self.current_shard != 0:
            self.current_shard = 0
            self.tokens = _load_data_shard(self.files[self.current_shard])
        self.current_position = self.process_rank * self.B * self.T

    def advance(self):  # advance to next data shard
        self.current_shard = (self.current_shard + 1) % len(self.files)
        self.current_position = self.process_rank * self.B * self.T
        self.tokens = _load_data_shard(self.files[self.current_shard])

    def next_batch(self):
        B = self.B  # noqa: N806
        T = self.T  # noqa: N806
        buf = self.tokens[self.current_position : self.current_position + B * T + 1]
        buf = torch.tensor(buf.astype(np.int32), dtype=torch.long)
        x = (buf[:-1]).view(B, T)
        y = (buf[1:]).view(B, T)
        self.current_position += B * T * self.num_processes
        if self.current_position + (B * T * self.num_processes + 1) > len(self.tokens):
            self.advance()
        return x, y


class LoaderSteps:
    """Ported: ``next_batch()`` is all DistributedDataLoader has (prepare says it is not
    iterable). Each item is one optimizer step's micro-batches, taken from it in the
    script's order; its state_dict is the loader's place (shard, position)."""

    def __init__(self, loader: DistributedDataLoader, grad_accum_steps: int) -> None:
        self.loader, self.grad_accum_steps = loader, grad_accum_steps

    def __iter__(self):
        while True:
            yield [self.loader.next_batch() for _ in range(self.grad_accum_steps)]

    def state_dict(self) -> dict[str, Any]:
        return {"shard": self.loader.current_shard, "position": self.loader.current_position}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        loader = self.loader
        if saved["shard"] != loader.current_shard:
            loader.current_shard = saved["shard"]
            loader.tokens = _load_data_shard(loader.files[loader.current_shard])
        loader.current_position = saved["position"]


def llmc(
    session: Session | None,
    data_dir: str,
    zero_stage: int = 0,
    num_iterations: int = 6,
    val_loss_every: int = 2,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """train_gpt2.py's training (``--model d12`` shrunk to 2 layers of 16, vocabulary
    64, block 16; no tokenizer, tensors written nor samples), batch 2 x 8 tokens,
    total batch 64 tokens (2 micro-steps on 2 ranks), lr 1e-3 with 1 warmup step and a
    cosine decay to a tenth, weight decay 0.1, val loss over 2 batches every
    ``val_loss_every`` steps, on the shards in ``data_dir`` (`synthetic_llmc_shards`).
    On CPU ranks: DDP without device_ids, and the mean loss all-reduced as a sum
    divided by the ranks (gloo has no ReduceOp.AVG). Ported: the model (in DDP), the
    optimizer and `LoaderSteps` prepared, each step's micro-batches taken from it.
    ``stop_after``: the script stops after that many steps. Returns the steps' mean
    losses, norms, lrs, val losses, the parameters and the summary."""
    args = SimpleNamespace(
        batch_size=2,
        sequence_length=8,
        total_batch_size=64,
        num_iterations=num_iterations,
        learning_rate=1e-3,
        warmup_iters=1,
        learning_rate_decay_frac=0.1,
        weight_decay=0.1,
        grad_clip=1.0,
        val_loss_every=val_loss_every,
        val_max_steps=2,
        overfit_single_batch=0,
        zero_stage=zero_stage,
    )
    B, T = args.batch_size, args.sequence_length  # noqa: N806
    ddp = dist.is_initialized()
    if ddp:
        ddp_rank, ddp_world_size = dist.get_rank(), dist.get_world_size()
        zero_stage = args.zero_stage
    else:
        ddp_rank, ddp_world_size, zero_stage = 0, 1, 0
    device = "cpu"
    tokens_per_fwdbwd = B * T * ddp_world_size
    assert args.total_batch_size % tokens_per_fwdbwd == 0
    grad_accum_steps = args.total_batch_size // tokens_per_fwdbwd
    torch.manual_seed(42)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    model.train()
    model.to(device)
    train_loader = DistributedDataLoader(
        os.path.join(data_dir, "train_*.bin"), B, T, ddp_rank, ddp_world_size
    )
    val_loader = DistributedDataLoader(
        os.path.join(data_dir, "val_*.bin"), B, T, ddp_rank, ddp_world_size
    )
    if ddp:
        model = DDP(model)  # the script's device_ids=[ddp_local_rank] is a GPU's
    raw_model = model.module if ddp else model
    optimizer = raw_model.configure_optimizers(
        weight_decay=args.weight_decay,
        learning_rate=args.learning_rate,
        betas=(0.9, 0.95),
        device_type=device,
        zero_stage=zero_stage,
    )

    def get_lr(it):
        min_lr = args.learning_rate * args.learning_rate_decay_frac
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / args.warmup_iters
        if it > args.num_iterations:
            return min_lr
        decay_ratio = (it - args.warmup_iters) / (args.num_iterations - args.warmup_iters)
        assert 0 <= decay_ratio <= 1
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (args.learning_rate - min_lr)

    first = 0
    train_steps: Any = None
    if session is not None:
        model, optimizer, train_steps = session.prepare(
            model, optimizer, LoaderSteps(train_loader, grad_accum_steps)
        )
        first = session.start().step
        train_steps = iter(train_steps)
    losses: list[float] = []
    norms: list[float] = []
    lrs: list[float] = []
    val_losses: list[tuple[int, float]] = []
    for step in range(first, args.num_iterations + 1):
        last_step = step == args.num_iterations
        if args.val_loss_every > 0 and (step % args.val_loss_every == 0 or last_step):
            with session.paused("evaluation") if session is not None else nullcontext():
                model.eval()
                val_loader.reset()
                with torch.no_grad():
                    val_loss = 0.0
                    for _ in range(args.val_max_steps):
                        x, y = val_loader.next_batch()
                        x, y = x.to(device), y.to(device)
                        _, loss = model(x, y, return_logits=False)
                        val_loss += loss.item()
                    val_loss /= args.val_max_steps
                val_losses.append((step, val_loss))
        if last_step:
            break
        model.train()
        optimizer.zero_grad(set_to_none=True)
        if args.overfit_single_batch:
            train_loader.reset()
        micro_batches = next(train_steps) if session is not None else None
        lossf = 0.0
        for micro_step in range(grad_accum_steps):
            if session is not None:
                x, y = micro_batches[micro_step]
            else:
                x, y = train_loader.next_batch()
            x, y = x.to(device), y.to(device)
            if ddp:
                model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
            _, loss = model(x, y, return_logits=False)
            loss = loss / grad_accum_steps
            lossf += loss.detach()
            loss.backward()
        if ddp:
            dist.all_reduce(lossf, op=dist.ReduceOp.SUM)  # gloo: no ReduceOp.AVG
            lossf = lossf / ddp_world_size
        lossf = lossf.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        lr = get_lr(step)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        optimizer.step()
        losses.append(lossf)
        norms.append(norm.item())
        lrs.append(lr)
        if step + 1 == stop_after:
            break
    summary = session.finish() if session is not None else None
    return {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "val": val_losses,
        "params": flat(raw_model),
        "summary": summary,
    }


def llmc_on_two_ranks(data_dir: str, ways: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """In one 2-rank group, train_gpt2.py each way: ``script`` (as it is, in DDP),
    ``plain`` (ported), or ``first`` then ``resumed`` (ported with a checkpoint every
    2 steps in ``data_dir``'s run folder; ``first`` stops after 3 steps). Returns each
    way's results and notes."""
    init_world("cpu", "gloo")
    results = {}
    try:
        for way in ways:
            session = None
            if way == "plain":
                session = Session(device="cpu")
            elif way in ("first", "resumed"):
                run = [get_optimization("checkpoint")(every=2, final=False)]
                session = Session(run, device="cpu", run_dir=os.path.join(data_dir, "run"))
            stop = {"stop_after": 3} if way == "first" else {}
            results[way] = llmc(session, data_dir, **kwargs, **stop)
            summary = results[way].pop("summary") or {}
            results[way]["notes"] = summary.get("notes", [])
            checkpoint = summary.get("optimizations", {}).get("checkpoint") or {}
            results[way]["resumed_from_step"] = checkpoint.get("resumed_from_step")
        return results
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------- seq2seq
# pytorch/tutorials' intermediate_source/seq2seq_translation_tutorial.py: its Lang,
# normalizeString, filterPairs, EncoderRNN, BahdanauAttention, AttnDecoderRNN,
# get_dataloader, train_epoch and evaluate, on a synthetic eng-fra corpus (the
# tutorial downloads data/eng-fra.txt); MAX_LENGTH 6 for 10.
SOS_token = 0
EOS_token = 1
MAX_LENGTH = 6


class Lang:
    def __init__(self, name):
        self.name = name
        self.word2index = {}
        self.word2count = {}
        self.index2word = {0: "SOS", 1: "EOS"}
        self.n_words = 2  # Count SOS and EOS

    def addSentence(self, sentence):  # noqa: N802 - the tutorial's names
        for word in sentence.split(" "):
            self.addWord(word)

    def addWord(self, word):  # noqa: N802
        if word not in self.word2index:
            self.word2index[word] = self.n_words
            self.word2count[word] = 1
            self.index2word[self.n_words] = word
            self.n_words += 1
        else:
            self.word2count[word] += 1


def unicodeToAscii(s):  # noqa: N802
    return "".join(c for c in unicodedata.normalize("NFD", s) if unicodedata.category(c) != "Mn")


def normalizeString(s):  # noqa: N802
    s = unicodeToAscii(s.lower().strip())
    s = re.sub(r"([.!?])", r" \1", s)
    s = re.sub(r"[^a-zA-Z.!?]+", r" ", s)
    return s.strip()


def synthetic_eng_fra(count: int = 40, seed: int = 0) -> list[str]:
    """``count`` lines of data/eng-fra.txt's form (``English\\tFrench``), drawn from
    their own generator; a few too long or not of the kept prefixes, as filterPairs
    drops."""
    rng = random.Random(seed)
    subjects = [("I am", "Je suis"), ("He is", "Il est"), ("She is", "Elle est"),
                ("We are", "Nous sommes"), ("You're", "Vous êtes"), ("They are", "Ils sont")]  # fmt: skip
    words = [("cold", "froid"), ("tired", "fatigué"), ("happy", "heureux"), ("late", "en retard"),
             ("very", "très"), ("not", "pas"), ("here", "ici"), ("old", "vieux")]  # fmt: skip
    lines = []
    for _ in range(count):
        eng, fra = rng.choice(subjects) if rng.random() > 0.1 else ("It is", "C'est")
        for _ in range(rng.randint(1, 3)):
            e, f = rng.choice(words)
            eng, fra = f"{eng} {e}", f"{fra} {f}"
        lines.append(f"{eng}.\t{fra}.")
    return lines


def readLangs(lang1, lang2, reverse=False, lines=()):  # noqa: N802
    # Split every line into pairs and normalize (the file's lines given, not read)
    pairs = [[normalizeString(s) for s in line.split("\t")] for line in lines]

    # Reverse pairs, make Lang instances
    if reverse:
        pairs = [list(reversed(p)) for p in pairs]
        input_lang = Lang(lang2)
        output_lang = Lang(lang1)
    else:
        input_lang = Lang(lang1)
        output_lang = Lang(lang2)

    return input_lang, output_lang, pairs


eng_prefixes = ("i am ", "i m ", "he is", "he s ", "she is", "she s ", "you are", "you re ",
                "we are", "we re ", "they are", "they re ")  # fmt: skip


def filterPair(p):  # noqa: N802
    return (
        len(p[0].split(" ")) < MAX_LENGTH
        and len(p[1].split(" ")) < MAX_LENGTH
        and p[1].startswith(eng_prefixes)
    )


def filterPairs(pairs):  # noqa: N802
    return [pair for pair in pairs if filterPair(pair)]


def prepareData(lang1, lang2, reverse=False, lines=()):  # noqa: N802
    input_lang, output_lang, pairs = readLangs(lang1, lang2, reverse, lines)
    pairs = filterPairs(pairs)
    for pair in pairs:
        input_lang.addSentence(pair[0])
        output_lang.addSentence(pair[1])
    return input_lang, output_lang, pairs


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size, dropout_p=0.1):
        super().__init__()
        self.hidden_size = hidden_size

        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, input):
        embedded = self.dropout(self.embedding(input))
        output, hidden = self.gru(embedded)
        return output, hidden


class BahdanauAttention(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.Wa = nn.Linear(hidden_size, hidden_size)
        self.Ua = nn.Linear(hidden_size, hidden_size)
        self.Va = nn.Linear(hidden_size, 1)

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))
        scores = scores.squeeze(2).unsqueeze(1)

        weights = F.softmax(scores, dim=-1)
        context = torch.bmm(weights, keys)

        return context, weights


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1):
        super().__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.attention = BahdanauAttention(hidden_size)
        self.gru = nn.GRU(2 * hidden_size, hidden_size, batch_first=True)
        self.out = nn.Linear(hidden_size, output_size)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, encoder_outputs, encoder_hidden, target_tensor=None):
        batch_size = encoder_outputs.size(0)
        decoder_input = torch.empty(batch_size, 1, dtype=torch.long).fill_(SOS_token)
        decoder_hidden = encoder_hidden
        decoder_outputs = []
        attentions = []

        for i in range(MAX_LENGTH):
            decoder_output, decoder_hidden, attn_weights = self.forward_step(
                decoder_input, decoder_hidden, encoder_outputs
            )
            decoder_outputs.append(decoder_output)
            attentions.append(attn_weights)

            if target_tensor is not None:
                # Teacher forcing: Feed the target as the next input
                decoder_input = target_tensor[:, i].unsqueeze(1)  # Teacher forcing
            else:
                # Without teacher forcing: use its own predictions as the next input
                _, topi = decoder_output.topk(1)
                decoder_input = topi.squeeze(-1).detach()  # detach from history as input

        decoder_outputs = torch.cat(decoder_outputs, dim=1)
        decoder_outputs = F.log_softmax(decoder_outputs, dim=-1)
        attentions = torch.cat(attentions, dim=1)

        return decoder_outputs, decoder_hidden, attentions

    def forward_step(self, input, hidden, encoder_outputs):
        embedded = self.dropout(self.embedding(input))

        query = hidden.permute(1, 0, 2)
        context, attn_weights = self.attention(query, encoder_outputs)
        input_gru = torch.cat((embedded, context), dim=2)

        output, hidden = self.gru(input_gru, hidden)
        output = self.out(output)

        return output, hidden, attn_weights


def indexesFromSentence(lang, sentence):  # noqa: N802
    return [lang.word2index[word] for word in sentence.split(" ")]


def tensorFromSentence(lang, sentence):  # noqa: N802
    indexes = indexesFromSentence(lang, sentence)
    indexes.append(EOS_token)
    return torch.tensor(indexes, dtype=torch.long).view(1, -1)


def get_dataloader(batch_size, lines):
    input_lang, output_lang, pairs = prepareData("eng", "fra", True, lines)

    n = len(pairs)
    input_ids = np.zeros((n, MAX_LENGTH), dtype=np.int32)
    target_ids = np.zeros((n, MAX_LENGTH), dtype=np.int32)

    for idx, (inp, tgt) in enumerate(pairs):
        inp_ids = indexesFromSentence(input_lang, inp)
        tgt_ids = indexesFromSentence(output_lang, tgt)
        inp_ids.append(EOS_token)
        tgt_ids.append(EOS_token)
        input_ids[idx, : len(inp_ids)] = inp_ids
        target_ids[idx, : len(tgt_ids)] = tgt_ids

    train_data = TensorDataset(torch.LongTensor(input_ids), torch.LongTensor(target_ids))

    train_sampler = RandomSampler(train_data)
    train_dataloader = DataLoader(train_data, sampler=train_sampler, batch_size=batch_size)
    return input_lang, output_lang, pairs, train_dataloader


def seq2seq(
    session: Session | None,
    n_epochs: int = 3,
    hidden_size: int = 16,
    batch_size: int = 8,
    sentences: int = 48,
    prepare: str = "encoder",
    register: tuple[str, ...] = ("model", "optimizer"),
    stop_after: int | None = None,
) -> dict[str, Any]:
    """The tutorial's training (``train``: Adam lr 0.001 for each module, NLLLoss, per
    epoch ``train_epoch``: both zero_grad, encoder then decoder forward with teacher
    forcing, one backward, encoder_optimizer.step() then decoder_optimizer.step()),
    then ``evaluate`` (greedy decoding) of every pair, in eval mode. Ported: the
    ``prepare``d module (``encoder`` or ``decoder``) with its optimizer and the
    loader, the other pair given to `Session.start` (``register``: or left out).
    ``stop_after``: the script stops after that many steps. Returns each step's loss,
    each epoch's average (as train_epoch returns it), the decoded sentences, both
    modules' parameters and the summary."""
    torch.manual_seed(0)
    lines = synthetic_eng_fra(sentences)
    input_lang, output_lang, pairs, train_dataloader = get_dataloader(batch_size, lines)

    encoder = EncoderRNN(input_lang.n_words, hidden_size)
    decoder = AttnDecoderRNN(hidden_size, output_lang.n_words)

    learning_rate = 0.001
    encoder_optimizer = optim.Adam(encoder.parameters(), lr=learning_rate)
    decoder_optimizer = optim.Adam(decoder.parameters(), lr=learning_rate)
    criterion = nn.NLLLoss()
    losses: list[float] = []
    averages: list[float] = []

    def train_epoch(dataloader, encoder, decoder, encoder_optimizer, decoder_optimizer, criterion):
        total_loss = 0
        for data in dataloader:
            input_tensor, target_tensor = data

            encoder_optimizer.zero_grad()
            decoder_optimizer.zero_grad()

            encoder_outputs, encoder_hidden = encoder(input_tensor)
            decoder_outputs, _, _ = decoder(encoder_outputs, encoder_hidden, target_tensor)

            loss = criterion(
                decoder_outputs.view(-1, decoder_outputs.size(-1)), target_tensor.view(-1)
            )
            loss.backward()

            encoder_optimizer.step()
            decoder_optimizer.step()

            total_loss += loss.item()
            losses.append(loss.item())
            if len(losses) == stop_after:
                return None

        return total_loss / len(dataloader)

    def evaluate(encoder, decoder, sentence, input_lang, output_lang):
        with torch.no_grad():
            input_tensor = tensorFromSentence(input_lang, sentence)

            encoder_outputs, encoder_hidden = encoder(input_tensor)
            decoder_outputs, decoder_hidden, decoder_attn = decoder(encoder_outputs, encoder_hidden)

            _, topi = decoder_outputs.topk(1)
            decoded_ids = topi.squeeze()

            decoded_words = []
            for idx in decoded_ids:
                if idx.item() == EOS_token:
                    decoded_words.append("<EOS>")
                    break
                decoded_words.append(output_lang.index2word[idx.item()])
        return decoded_words, decoder_attn

    first = 1
    if session is not None:
        if prepare == "encoder":
            encoder, encoder_optimizer, train_dataloader = session.prepare(
                encoder, encoder_optimizer, train_dataloader
            )
            others = {
                "model": ("decoder", decoder),
                "optimizer": ("decoder_optimizer", decoder_optimizer),
            }
        else:
            decoder, decoder_optimizer, train_dataloader = session.prepare(
                decoder, decoder_optimizer, train_dataloader
            )
            others = {
                "model": ("encoder", encoder),
                "optimizer": ("encoder_optimizer", encoder_optimizer),
            }
        first = session.start(**dict(others[key] for key in register)).epoch + 1
    for epoch in range(first, n_epochs + 1):  # noqa: B007 - the tutorial's loop
        loss = train_epoch(
            train_dataloader, encoder, decoder, encoder_optimizer, decoder_optimizer, criterion
        )
        if loss is None:
            break
        averages.append(loss)
    summary = session.finish() if session is not None else None

    encoder.eval()
    decoder.eval()
    decoded = [
        " ".join(evaluate(encoder, decoder, pair[0], input_lang, output_lang)[0]) for pair in pairs
    ]
    return {
        "losses": losses,
        "averages": averages,
        "decoded": decoded,
        "pairs": len(pairs),
        "encoder": flat(encoder),
        "decoder": flat(decoder),
        "summary": summary,
    }


# ---------------------------------------------------------------------- char_rnn
# pytorch/tutorials' intermediate_source/char_rnn_classification_tutorial.py (the
# current one: NamesDataset, random_split, CharRNN over nn.RNN, a train() that makes
# its own minibatches), on synthetic name files (the tutorial downloads data/names).
allowed_characters = string.ascii_letters + " .,;'" + "_"
n_letters = len(allowed_characters)


def unicodeToAsciiName(s):  # noqa: N802 - the tutorial's unicodeToAscii
    return "".join(
        c
        for c in unicodedata.normalize("NFD", s)
        if unicodedata.category(c) != "Mn" and c in allowed_characters
    )


def letterToIndex(letter):  # noqa: N802
    # return our out-of-vocabulary character if we encounter a letter unknown to our model
    if letter not in allowed_characters:
        return allowed_characters.find("_")
    else:
        return allowed_characters.find(letter)


def lineToTensor(line):  # noqa: N802
    tensor = torch.zeros(len(line), 1, n_letters)
    for li, letter in enumerate(line):
        tensor[li][0][letterToIndex(letter)] = 1
    return tensor


def synthetic_name_files(folder, per_language: int = 10, seed: int = 0) -> None:
    """``Language.txt`` files of made-up names, one a line, each language its own
    letters and endings (a few with accents, which unicodeToAscii strips)."""
    rng = random.Random(seed)
    languages = {
        "Italian": ("bcdfglmnprstv", "aeiou", ("ini", "etti", "one")),
        "Japanese": ("hkmnstwy", "aiou", ("moto", "saki", "da")),
        "Polish": ("kwzscpr", "aeoy", ("ski", "czyk", "ak")),
        "Scottish": ("mcdlgrn", "aeiu", ("son", "ie", "ach")),
    }
    for language, (consonants, vowels, endings) in languages.items():
        names = []
        for _ in range(per_language):
            stem = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(2))
            names.append(stem.capitalize() + rng.choice(endings))
        names[0] = names[0][:-1] + "à"  # Ślusàrski's kind
        with open(os.path.join(folder, f"{language}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(names) + "\n")


class NamesDataset(Dataset):
    def __init__(self, data_dir):
        self.data_dir = data_dir  # for provenance of the dataset
        labels_set = set()  # set of all classes

        self.data = []
        self.data_tensors = []
        self.labels = []
        self.labels_tensors = []

        # read all the ``.txt`` files in the specified directory
        text_files = sorted(glob.glob(os.path.join(data_dir, "*.txt")))  # (sorted: same order)
        for filename in text_files:
            label = os.path.splitext(os.path.basename(filename))[0]
            labels_set.add(label)
            with open(filename, encoding="utf-8") as f:  # (the tutorial leaves it open)
                lines = f.read().strip().split("\n")
            for name in lines:
                name = unicodeToAsciiName(name)
                self.data.append(name)
                self.data_tensors.append(lineToTensor(name))
                self.labels.append(label)

        # Cache the tensor representation of the labels
        self.labels_uniq = sorted(labels_set)  # (list(labels_set): by PYTHONHASHSEED)
        for idx in range(len(self.labels)):
            temp_tensor = torch.tensor([self.labels_uniq.index(self.labels[idx])], dtype=torch.long)
            self.labels_tensors.append(temp_tensor)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        data_item = self.data[idx]
        data_label = self.labels[idx]
        data_tensor = self.data_tensors[idx]
        label_tensor = self.labels_tensors[idx]

        return label_tensor, data_tensor, data_label, data_item


class CharRNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()

        self.rnn = nn.RNN(input_size, hidden_size)
        self.h2o = nn.Linear(hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, line_tensor):
        rnn_out, hidden = self.rnn(line_tensor)
        output = self.h2o(hidden[0])
        output = self.softmax(output)

        return output


def label_from_output(output, output_labels):
    top_n, top_i = output.topk(1)
    label_i = top_i[0].item()
    return output_labels[label_i], label_i


def char_rnn(
    session: Session | None,
    data_dir: str,
    n_epoch: int = 3,
    n_hidden: int = 8,
    n_batch_size: int = 8,
    learning_rate: float = 0.15,
    way: str = "range",
    register: tuple[str, ...] = ("batches",),
    stop_after: int | None = None,
) -> dict[str, Any]:
    """The tutorial's ``train(rnn, train_set, n_epoch, n_batch_size, report_every,
    learning_rate, criterion)``: SGD; each epoch a list of the sample indices
    ``random.shuffle``d and ``np.array_split`` into len // n_batch_size minibatches;
    per minibatch one forward per name (its own length), the losses summed, one
    backward, clip_grad_norm_ 3, step, zero_grad; then ``evaluate`` on the test set
    (the confusion matrix, no plot). Seeded (random, torch: the tutorial is not).
    Ported (``way``): ``range``: the prepared loader is ``range(n_batches)``, each
    step the index of the epoch's minibatch; ``epoch``: no loader prepared, each
    epoch's list of minibatches iterated through ``session.epoch(batches)``.
    ``register``: ``batches`` (the epoch's minibatches, given to `Session.start`: a
    resume mid-epoch goes on with them, not a new shuffle) or nothing. ``stop_after``:
    the script stops after that many minibatches. Returns each minibatch's loss, each
    epoch's average (as all_losses), the confusion matrix, the parameters and the
    summary."""
    random.seed(0)
    torch.manual_seed(0)
    device = "cpu"
    alldata = NamesDataset(data_dir)
    train_set, test_set = torch.utils.data.random_split(
        alldata, [0.85, 0.15], generator=torch.Generator(device=device).manual_seed(2024)
    )
    rnn = CharRNN(n_letters, n_hidden, len(alldata.labels_uniq))
    losses: list[float] = []

    def train(rnn, training_data, n_epoch=10, n_batch_size=64, report_every=50,
              learning_rate=0.2, criterion=nn.NLLLoss()):  # noqa: B008  # fmt: skip
        # Keep track of losses for plotting
        current_loss = 0
        all_losses = []
        rnn.train()
        optimizer = torch.optim.SGD(rnn.parameters(), lr=learning_rate)

        n_batches = len(training_data) // n_batch_size
        first, steps, batches, resumed = 1, None, None, False
        if session is not None:
            loader = range(n_batches) if way == "range" else None
            rnn, optimizer, steps = session.prepare(rnn, optimizer, loader)
            getters = {"batches": lambda: [b.tolist() for b in batches or []]}
            start = session.start(**{name: getters[name] for name in register})
            first = start.epoch + 1
            if start.batch > 0 and "batches" in register:
                batches, resumed = [np.array(b) for b in start.values["batches"]], True
        for iter in range(first, n_epoch + 1):  # noqa: A001, B007 - the tutorial's
            rnn.zero_grad()  # clear the gradients

            # create some minibatches
            # we cannot use dataloaders because each of our names is a different length
            if resumed:  # the epoch the checkpoint was taken in: its minibatches
                resumed = False
            else:
                batches = list(range(len(training_data)))
                random.shuffle(batches)
                batches = np.array_split(batches, len(batches) // n_batch_size)

            if session is None:
                pairs = enumerate(batches)
            elif way == "range":
                pairs = ((idx, batches[idx]) for idx in steps)
            else:
                pairs = enumerate(session.epoch(batches))
            for idx, batch in pairs:  # noqa: B007 - the tutorial's
                batch_loss = 0
                for i in batch:  # for each example in this batch
                    (label_tensor, text_tensor, label, text) = training_data[i]
                    output = rnn.forward(text_tensor)
                    loss = criterion(output, label_tensor)
                    batch_loss += loss

                # optimize parameters
                batch_loss.backward()
                nn.utils.clip_grad_norm_(rnn.parameters(), 3)
                optimizer.step()
                optimizer.zero_grad()

                current_loss += batch_loss.item() / len(batch)
                losses.append(batch_loss.item())
                if len(losses) == stop_after:
                    return all_losses

            all_losses.append(current_loss / len(batches))
            current_loss = 0

        return all_losses

    all_losses = train(rnn, train_set, n_epoch=n_epoch, n_batch_size=n_batch_size,
                       learning_rate=learning_rate, report_every=1)  # fmt: skip
    summary = session.finish() if session is not None else None

    classes = alldata.labels_uniq
    confusion = torch.zeros(len(classes), len(classes))
    rnn.eval()  # set to eval mode
    with torch.no_grad():  # do not record the gradients during eval phase
        for i in range(len(test_set)):
            (label_tensor, text_tensor, label, text) = test_set[i]
            output = rnn(text_tensor)
            guess, guess_i = label_from_output(output, classes)
            label_i = classes.index(label)
            confusion[label_i][guess_i] += 1
    return {
        "losses": losses,
        "averages": all_losses,
        "confusion": confusion,
        "sizes": (len(train_set), len(test_set)),
        "params": flat(rnn),
        "summary": summary,
    }


# --------------------------------------------------------------- transfer_learning
# pytorch/tutorials' beginner_source/transfer_learning_tutorial.py: train_model(), its
# train and val phases each epoch, the best weights kept in a temporary file (or, in
# older versions, a deepcopy of the state dict) and loaded back at the end.
def transfer_learning(
    session: Session | None,
    num_epochs: int = 3,
    batch_size: int = 4,
    images: int = 16,
    keep: str = "file",
    register: tuple[str, ...] = ("exp_lr_scheduler", "best_acc", "best_model"),
    stop_after: int | None = None,
) -> dict[str, Any]:
    """The tutorial's finetuning (``model_ft``: resnet18, its ``fc`` replaced by a
    2-class Linear, CrossEntropyLoss, SGD lr 0.001 momentum 0.9, StepLR step_size 7
    gamma 0.1, here step_size 2) through ``train_model``: per epoch a ``train`` phase
    (shuffled, model.train()) then a ``val`` phase (model.eval(), the same model,
    under ``torch.set_grad_enabled(False)``), ``scheduler.step()`` after the train
    phase, the best val accuracy's weights saved (``keep``: ``"file"``, torch.save to
    a TemporaryDirectory as now; ``"copy"``, copy.deepcopy(model.state_dict()) as
    before) and loaded back at the end. TinyResNet for the pretrained resnet18 (its
    "pretrained" weights the seeded init), ``images`` synthetic 3x32x32 images a phase
    for hymenoptera_data, num_workers 0. Ported: the train loader prepared, its phase
    iterating it; ``register`` names what is given to `Session.start` (the schedule,
    ``best_acc`` and the best weights as values, taken back from ``start.values``).
    ``stop_after``: the script stops after that many steps. Returns each step's loss,
    each phase's (loss, acc) as printed (a resumed epoch's train figures are of the
    batches this run trained), best_acc, the final parameters and the summary."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    image_datasets = {
        x: TensorDataset(
            torch.randn(images, 3, 32, 32, generator=generator),
            torch.arange(images) % 2,
        )
        for x in ["train", "val"]
    }
    dataloaders = {
        x: DataLoader(image_datasets[x], batch_size=batch_size, shuffle=(x == "train"))
        for x in ["train", "val"]
    }
    dataset_sizes = {x: len(image_datasets[x]) for x in ["train", "val"]}
    device = torch.device("cpu")
    losses: list[float] = []
    history: list[tuple[str, float, float]] = []

    def train_model(model, criterion, optimizer, scheduler, num_epochs=25):
        # Create a temporary directory to save training checkpoints
        with TemporaryDirectory() as tempdir:
            best_model_params_path = os.path.join(tempdir, "best_model_params.pt")
            if keep == "file":
                torch.save(model.state_dict(), best_model_params_path)
            else:
                best_model_wts = copy.deepcopy(model.state_dict())
            best_acc = 0.0

            first = 0
            if session is not None:
                model, optimizer, dataloaders["train"] = session.prepare(
                    model, optimizer, dataloaders["train"]
                )

                def best_model():
                    if keep == "file":
                        return torch.load(best_model_params_path, weights_only=True)
                    return best_model_wts

                getters: dict[str, Any] = {
                    "exp_lr_scheduler": scheduler,
                    "best_acc": lambda: best_acc,
                    "best_model": best_model,
                }
                start = session.start(
                    **{name: getters[name] for name in register}, history=lambda: history
                )
                first, values = start.epoch, start.values
                if start.resumed_from is not None:
                    history[:] = values["history"]
                    if "best_acc" in register:
                        best_acc = values["best_acc"]
                    if "best_model" in register and keep == "file":
                        torch.save(values["best_model"], best_model_params_path)
                    elif "best_model" in register:
                        best_model_wts = values["best_model"]

            for epoch in range(first, num_epochs):  # noqa: B007 - the tutorial's loop
                # Each epoch has a training and validation phase
                for phase in ["train", "val"]:
                    if phase == "train":
                        model.train()  # Set model to training mode
                    else:
                        model.eval()  # Set model to evaluate mode

                    running_loss = 0.0
                    running_corrects = 0

                    # Iterate over data.
                    for inputs, labels in dataloaders[phase]:
                        inputs = inputs.to(device)
                        labels = labels.to(device)

                        # zero the parameter gradients
                        optimizer.zero_grad()

                        # forward
                        # track history if only in train
                        with torch.set_grad_enabled(phase == "train"):
                            outputs = model(inputs)
                            _, preds = torch.max(outputs, 1)
                            loss = criterion(outputs, labels)

                            # backward + optimize only if in training phase
                            if phase == "train":
                                loss.backward()
                                optimizer.step()

                        # statistics
                        running_loss += loss.item() * inputs.size(0)
                        running_corrects += torch.sum(preds == labels.data)
                        if phase == "train":
                            losses.append(loss.item())
                            if len(losses) == stop_after:
                                return model, best_acc
                    if phase == "train":
                        scheduler.step()

                    epoch_loss = running_loss / dataset_sizes[phase]
                    epoch_acc = (running_corrects.double() / dataset_sizes[phase]).item()
                    history.append((phase, epoch_loss, epoch_acc))

                    # deep copy the model
                    if phase == "val" and epoch_acc > best_acc:
                        best_acc = epoch_acc
                        if keep == "file":
                            torch.save(model.state_dict(), best_model_params_path)
                        else:
                            best_model_wts = copy.deepcopy(model.state_dict())

            # load best model weights
            if keep == "file":
                model.load_state_dict(torch.load(best_model_params_path, weights_only=True))
            else:
                model.load_state_dict(best_model_wts)
        return model, best_acc

    model_ft = resnet18(weights="IMAGENET1K_V1")
    num_ftrs = model_ft.fc.in_features
    # Here the size of each output sample is set to 2.
    model_ft.fc = nn.Linear(num_ftrs, 2)
    model_ft = model_ft.to(device)
    criterion = nn.CrossEntropyLoss()
    # Observe that all parameters are being optimized
    optimizer_ft = optim.SGD(model_ft.parameters(), lr=0.001, momentum=0.9)
    # Decay LR by a factor of 0.1 every 7 epochs (every 2 here)
    exp_lr_scheduler = StepLR(optimizer_ft, step_size=2, gamma=0.1)
    model_ft, best_acc = train_model(
        model_ft, criterion, optimizer_ft, exp_lr_scheduler, num_epochs=num_epochs
    )
    summary = session.finish() if session is not None else None
    return {
        "losses": losses,
        "history": history,
        "best_acc": best_acc,
        "lr": optimizer_ft.param_groups[0]["lr"],
        "params": flat(model_ft),
        "summary": summary,
    }
