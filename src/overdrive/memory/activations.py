"""Activation memory: the tensors the forward pass keeps for the backward pass.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.1. For one GPT layer with 16-bit activations, 1-byte dropout masks and
attention that materialises the s x s scores, the stored bytes are

    s*b*h*(34 + 5*a*s/h)
      attention  11*s*b*h + 5*a*s^2*b   (QKV input 2, Q and K 4, softmax 2a*s/h, its dropout
                                          mask a*s/h, dropout output 2a*s/h, V 2, output
                                          projection input 2, dropout mask 1)
      MLP        19*s*b*h               (input 2, GeLU input 8, GeLU output 8, mask 1)
      norms       4*s*b*h               (two LayerNorm inputs, 2 each)

and with full recomputation only each layer's input (2*s*b*h) stays, plus one layer's
activations while that layer is recomputed in the backward pass (their sec. 4.2).

The same accounting, term by term, adapted to what Transformers and PyTorch actually save
(each adaptation checked by summing `saved_tensors_hooks` storages, tests/test_memory_activations.py):

- `e` bytes per matmul input and activation (4 in fp32), `r` bytes for the residual stream
  and norm inputs (fp32 under autocast, which keeps fp32 weights and adds in fp32).
- Fused attention (SDPA's flash / memory-efficient kernels, FlashAttention) keeps no s x s
  matrix: it saves Q, K, V, the output and a fp32 log-sum-exp per head (Dao et al. 2022).
  On CPU, SDPA has no fused kernel with dropout, so attention dropout means the math path.
- Dropout masks are bool (1 byte) on CUDA (`native_dropout`) but a float mask of the
  input's dtype on CPU.
- The activation function saves as many f-wide tensors as its autograd graph keeps: 1 for
  a fused kernel (`F.gelu`, `F.silu`), 4 for GPT-2's Python `gelu_new`. A gated MLP
  (SwiGLU) keeps gate, activation, up and product.
- LayerNorm keeps its fp32 mean and rstd (8 bytes per token); Transformers' RMSNorm, written
  in Python, keeps an fp32 copy of its input and its normalised output. Qwen3, Gemma 3 and OLMo 2
  normalise Q and K too (per head, or over their whole width): the same per element, and an fp32
  rsqrt per normalised row. Q, the attention output and the output projection's input are
  heads x head_dim wide, which is not the hidden size where the config says so (Qwen3's 128).
- Beyond the layers: the embedding dropout mask, the final norm and LM-head input, the
  logits the caller holds, the fp32 log-softmax output cross-entropy saves (Transformers
  up-casts logits before the loss), and the int64 shifted labels. At an 8k-128k vocabulary
  the head is often larger than several layers.
- The loss's peak depends on its kernel (`training.loss_kernel`, measured by
  bench/bench_loss_kernel.py): `full` keeps the fp32 log-softmax and adds its gradient and the
  logits' in backward (12 bytes x vocabulary per token with the log-softmax, the logits themselves
  dropped once the loss is taken unless the caller holds them); `chunked` holds one slice's fp32
  logits and log-softmax at a time, and in backward adds each slice's share into the head's
  weight gradient in place; `fused` (torch's chunked op, Liger) computes the gradients in
  forward and keeps them: the hidden states' (4 bytes x hidden per token) and the weight's, a
  chunk of about the hidden states' size at a time (config/loss_kernel.fused_chunk_tokens).
- Activation offloading (on CUDA) moves the saved tensors to host memory as they are saved: the
  device keeps about one layer's at a time, the host holds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from overdrive.memory.shape import ModelShape, Setup

# f-wide tensors an activation's autograd graph saves, input included (transformers/activations.py).
ACTIVATION_SAVES = {
    "gelu_new": 4,  # 0.5*x*(1+tanh(c*(x+0.044715*x^3))): x, tanh, 0.5*x, 1+tanh
    "gelu_fast": 7,  # the same in a longer Python expression
    "quick_gelu": 2,  # x*sigmoid(1.702*x): x and the sigmoid
    "gelu_python": 3,
}
FUSED_ACTIVATION_SAVES = 1  # F.gelu, F.silu, relu, ...: the input (or the output)
LAYERNORM_STATS = 8  # fp32 mean and rstd per token
RMSNORM_STATS = 4  # fp32 rsqrt per token
LABEL_BYTES = 8  # int64 labels, shifted (a contiguous copy)
LOSS_BACKWARD_FP32 = 8  # backward of fp32 cross-entropy: d(log_softmax) and d(logits), fp32 each


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> float:
    """The paper's per-layer figure, verbatim: 16-bit, eager attention, dropout everywhere."""
    return s * b * h * (34 + 5 * a * s / h)


AttentionKernel = Literal["flash", "math", "eager"]


def attention_kernel(shape: ModelShape, setup: Setup) -> AttentionKernel:
    """Which attention path runs, from the Transformers `attn_implementation` and the device."""
    impl = (shape.attn_implementation or "sdpa").lower()
    if impl == "eager":
        return "eager"
    if impl != "sdpa":  # flash_attention_2/3, flex_attention, kernels from the hub
        return "flash"
    if setup.target == "cuda":
        return "flash"  # flash or memory-efficient: both support dropout and keep no s x s
    return "math" if shape.attn_dropout > 0 else "flash"


@dataclass(frozen=True)
class Dtypes:
    """Bytes per stored element for one strategy and precision."""

    e: int  # matmul inputs, activations, logits
    r: int  # residual stream and norm inputs
    mask: int  # one dropout mask element

    @classmethod
    def of(cls, setup: Setup, autocast: bool) -> "Dtypes":
        e = setup.half_bytes
        r = 4 if (autocast or not setup.mixed) else e
        return cls(e=e, r=r, mask=1 if setup.target == "cuda" else e)


@dataclass(frozen=True)
class Activations:
    """Bytes per device for one micro-batch."""

    layer: int  # one layer's saved tensors (no checkpointing)
    layer_input: int  # one layer's input: all a checkpointed layer keeps
    embeddings: int
    head: int  # final norm, LM-head input, log-softmax output, labels
    logits: int  # held by the caller until backward
    loss_backward: int  # the loss's own peak in backward (its gradients; a slice's, under chunked)
    layers: int
    kernel: AttentionKernel
    logits_held: bool = True  # the caller keeps the logits until backward (the saved figures assume it)
    layers_on_device: int = 0  # under activation offloading, the layers whose saved tensors stay; 0: all
    vision: int = 0  # a vision tower that trains: its blocks' saved tensors over each row's image patches

    @property
    def resident_layers(self) -> int:
        """Layers whose saved tensors are on the device at once."""
        return self.layers_on_device or self.layers

    @property
    def logits_at_peak(self) -> int:
        return self.logits if self.logits_held else 0

    @property
    def saved(self) -> int:
        """Held at the end of the forward pass without checkpointing (what a hook measures)."""
        return self.layers * self.layer + self.embeddings + self.head + self.logits + self.vision

    @property
    def saved_checkpointed(self) -> int:
        """Held at the end of the forward pass with every layer checkpointed."""
        return self.layers * self.layer_input + self.embeddings + self.head + self.logits + self.vision

    @property
    def peak(self) -> int:
        """Peak without checkpointing: the saved tensors on the device, plus the loss's own peak."""
        return (self.resident_layers * self.layer + self.embeddings + self.head + self.logits_at_peak
                + self.loss_backward + self.vision)

    @property
    def peak_checkpointed(self) -> int:
        """Peak with checkpointing: inputs kept, plus one layer recomputed in backward."""
        return (self.resident_layers * self.layer_input + self.embeddings + self.head + self.logits_at_peak
                + self.layer + self.loss_backward + self.vision)


def _norm(shape: ModelShape, d: Dtypes) -> int:
    if shape.norm == "rmsnorm":
        # x.to(float32) (kept by pow and mul) and weight * normed.to(dtype) (kept by the mul).
        return 4 * shape.hidden + d.r * shape.hidden + RMSNORM_STATS
    return d.r * shape.hidden + LAYERNORM_STATS


def layer_bytes_per_token(shape: ModelShape, setup: Setup, d: Dtypes, kernel: AttentionKernel) -> float:
    """One layer's saved bytes per token (per sample position).

    Tensor parallel (Korthikanti et al. sec. 4.2.1, without their sequence parallelism): each tp
    rank keeps its heads' Q, K, V, attention output and scores and its slice of the MLP (the
    24/t of their 10 + 24/t); norm inputs, the projections' inputs and dropout masks stay whole."""
    t = setup.tp
    h, a, f, s = shape.hidden, shape.heads // t, shape.intermediate // t, setup.local_seq_len
    kv = shape.kv_heads // t * shape.head_dim
    q = a * shape.head_dim  # Q's width on this rank (heads x head_dim: the hidden size unless the config says)
    total = 0.0
    # --- attention block
    total += _norm(shape, d)
    total += d.e * h  # input of the Q/K/V projections
    for width, length in ((q, shape.q_norm), (kv, shape.k_norm)):  # Q's and K's own RMSNorms, where the model has them
        if length:
            total += (4 + d.r) * width + RMSNORM_STATS * width // length
    if kernel == "flash":
        total += d.e * (q + 2 * kv)  # Q, K, V
        # Output (also the output projection's input: merging heads is a view of the
        # kernel's (b, s, heads, d) layout) and the fp32 log-sum-exp per head.
        total += d.e * q + 4 * a
    else:
        kv_kept = q if kernel == "eager" else kv  # eager attention repeats K/V heads (repeat_kv)
        total += d.e * (q + 2 * kv_kept)
        total += d.e * a * s  # softmax output
        if shape.attn_dropout > 0:
            total += (d.mask + d.e) * a * s  # its dropout mask and output
        total += d.e * q  # output projection input (heads merged: a copy)
    if shape.resid_dropout > 0:
        total += d.mask * h
    # --- MLP block
    total += _norm(shape, d)
    total += d.e * h  # input of the first projection(s)
    act = ACTIVATION_SAVES.get(shape.activation, FUSED_ACTIVATION_SAVES)
    total += (act + (3 if shape.mlp == "gated" else 1)) * d.e * f
    if shape.resid_dropout > 0:
        total += d.mask * h
    return total


def estimate_activations(shape: ModelShape, setup: Setup, autocast: bool) -> Activations:
    d = Dtypes.of(setup, autocast)
    kernel = attention_kernel(shape, setup)
    tokens = setup.micro_batch * setup.local_seq_len  # context / sequence parallel split the sequence
    h = shape.hidden
    embeddings = tokens * (d.mask * h if shape.embd_dropout > 0 else 0)
    if shape.learned_positions:
        embeddings += 8 * setup.seq_len  # int64 position ids, kept by the lookup
    if shape.rotary:
        embeddings += 2 * setup.seq_len * shape.head_dim * d.r  # cos and sin, shared by the layers
    head, logits, loss_peak = loss_terms(shape, setup, d, tokens)
    return Activations(
        layer=round(tokens * layer_bytes_per_token(shape, setup, d, kernel)),
        layer_input=tokens * d.r * h,
        embeddings=embeddings,
        head=head,
        logits=logits,
        loss_backward=loss_peak,
        layers=shape.layers,
        kernel=kernel,
        logits_held=setup.logits_held,
        layers_on_device=1 if setup.activation_offloading and setup.target == "cuda" else 0,
        vision=_vision_tower(shape, setup, d),
    )


# Saved elements per patch per vision block, in units of its width: Korthikanti et al.'s 34 bytes (16-bit,
# dropout masks) less the masks a vision tower does not drop out, as elements: norms' inputs, Q, K, V, the
# attention output and the projections' inputs (~6), a 4x-wide MLP's input, activation and output (~9).
VISION_BLOCK_ELEMENTS = 15


def _vision_tower(shape: ModelShape, setup: Setup, d: Dtypes) -> int:
    """A vision tower that trains (model.vision.freeze off) keeps its blocks' activations for one image a row;
    a frozen one runs without any parameter or input asking for a gradient, and keeps none."""
    if not setup.image_patches or "vision" in setup.frozen_parts or setup.adapter is not None:
        return 0
    return setup.micro_batch * setup.image_patches * shape.vision_layers * VISION_BLOCK_ELEMENTS * d.e * \
        shape.vision_hidden


def loss_terms(shape: ModelShape, setup: Setup, d: Dtypes, tokens: int) -> tuple[int, int, int]:
    """(head, logits, the loss's peak in backward) for the run's loss kernel."""
    from overdrive.config.loss_kernel import chunk_tokens, fused_chunk_tokens

    h, v = shape.hidden, shape.vocab
    head_input = tokens * (_norm(shape, d) + d.e * h + LABEL_BYTES)  # final norm, LM-head input, labels
    if setup.loss_kernel == "chunked":
        # One slice's logits (and their fp32 up-cast) and log-softmax in forward; in backward one
        # slice's fp32 logits turned into their gradient in place; the hidden states' gradient.
        return head_input, 0, min(tokens, chunk_tokens(v)) * (8 + (d.e if d.e != 4 else 0)) * v + 4 * tokens * h
    if setup.loss_kernel == "fused":
        # The gradients computed in forward (hidden states', and the weight's unless an adapter run
        # leaves the head frozen), and one chunk's fp32 logits and their gradient: the kernels' own
        # chunks, a few tokens at a large vocabulary (not chunked's 64 MiB slices).
        frozen_head = setup.adapter is not None and not setup.adapter.head_trained
        weight_grad = 0 if frozen_head else 4 * v * h
        return head_input + 4 * tokens * h + weight_grad, 0, fused_chunk_tokens(tokens, h, v) * 8 * v
    return head_input + tokens * 4 * v, tokens * d.e * v, tokens * LOSS_BACKWARD_FP32 * v
