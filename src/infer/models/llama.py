"""The decoder of the Llama family: Llama 3.x, Mistral, Qwen2 (`qkv_bias`) and Qwen3 (`qk_norm`).

`LlamaForCausalLM.forward(input_ids, positions, view)` takes explicit positions and an `AttentionView` that owns the
KV cache. q/k/v and gate/up are fused `LinearBase` layers (`hf_to_fused` / `fused_to_hf` map Hugging Face names);
every step goes through the `Kernels` bundle with what surrounds it, so a fused bundle can merge them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from infer.models.capture import HiddenCapture
from infer.models.config import ModelConfig
from infer.models.kernels.bundle import EAGER, CompiledKernels, Kernels
from infer.models.layers.attention import AttentionView, NoCacheView
from infer.models.layers.linear import UNQUANTIZED, LinearBase, TiedRows, linear_layers, make_linear
from infer.models.layers.mlp import MLP
from infer.models.layers.norms import RMSNorm
from infer.models.layers.parallel import REPLICATED, Parallel, TensorPart, VocabParallelEmbedding
from infer.models.layers.rotary import Rotary, cos_sin
from infer.models.layers.shard import ModelShard, PartFn
from infer.models.vocab_rows import gathered_head, head_quantization, spread_logits


class Attention(nn.Module):
    """Grouped-query attention; q/k/v `column`-parallel (config: the rank's shape), o `row`-parallel."""

    def __init__(self, config: ModelConfig, layer: int, quantization: str | None = None, column: Parallel = REPLICATED,
                 row: Parallel = REPLICATED) -> None:
        super().__init__()
        self.layer = layer
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = make_linear(config.hidden_size, self.q_size + 2 * self.kv_size, quantization, column,
                                    bias=config.qkv_bias)
        self.o_proj = make_linear(self.q_size, config.hidden_size, quantization, row)
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # weights [head_dim], shared by the heads
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor, view: AttentionView,
                kernels: Kernels = EAGER) -> torch.Tensor:
        """x: the residual stream [B, T, H]; returns x + attention(norm(x)) [B, T, H]."""
        qkv = kernels.norm_linear(self.qkv_proj, x, norm.weight, norm.eps)  # [B, T, (Hq + 2 Hkv) D]
        return self.attend_qkv(qkv, x, cos, sin, view, kernels)

    def attend_qkv(self, qkv: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   view: AttentionView, kernels: Kernels = EAGER) -> torch.Tensor:
        """qkv [B, T, (Hq + 2 Hkv) D] -> residual + attention [B, T, H] (EAGLE projects its own qkv)."""
        b, t, _ = qkv.shape
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim)  # [B, T, Hq, D]
        k = k.view(b, t, self.kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.qk_norm:
            q = kernels.rmsnorm(q, self.q_norm.weight, self.q_norm.eps)
            k = kernels.rmsnorm(k, self.k_norm.weight, self.k_norm.eps)
        v = v.view(b, t, self.kv_heads, self.head_dim)  # [B, T, Hkv, D]
        out = kernels.attend(view, self.layer, q, k, v, cos, sin)  # [B, T, Hq, D]
        return kernels.linear(self.o_proj, out.reshape(b, t, self.q_size), residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, quantization: str | None = None,
                 shard: ModelShard | None = None) -> None:
        super().__init__()
        column, row = (REPLICATED, REPLICATED) if shard is None else (shard.column, shard.row)
        self.self_attn = Attention(config, layer, quantization, column, row)
        self.mlp = MLP(config, quantization, column, row)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view: AttentionView,
                kernels: Kernels = EAGER) -> torch.Tensor:
        """x: the residual stream [B, T, H] -> the stream after this layer."""
        x = self.self_attn(x, self.input_layernorm, cos, sin, view, kernels)
        norm = self.post_attention_layernorm
        return kernels.mlp(self.mlp.gate_up_proj, self.mlp.down_proj, x, norm.weight, norm.eps)


def _embedding(vocab_size: int, hidden_size: int, parallel: Parallel) -> nn.Embedding:
    """nn.Embedding (vocabulary-parallel: the rank's rows), not randomly initialised on the meta
    device (a meta `normal_` imports torch's Python decompositions, a large memory cost)."""
    start, stop = parallel.span(vocab_size)
    kwargs = {"_weight": torch.empty(stop - start, hidden_size)} if torch.get_default_device().type == "meta" else {}
    if parallel.kind == "vocab":
        return VocabParallelEmbedding(parallel, vocab_size, hidden_size, **kwargs)
    return nn.Embedding(vocab_size, hidden_size, **kwargs)


def _lm_head(config: ModelConfig, embedding: nn.Module, parallel: Parallel) -> LinearBase:
    """The head in the model's dtype: whole, or the rank's vocabulary rows (tied: read in place)."""
    start, stop = parallel.span(config.vocab_size)
    whole = embedding.weight.shape[0] == config.vocab_size
    tied_rows = config.tie_word_embeddings and parallel.kind == "vocab" and whole
    method = TiedRows(embedding, start, stop) if tied_rows else UNQUANTIZED  # type: ignore[arg-type]
    return LinearBase(config.hidden_size, stop - start, method, parallel)


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str | None = None, shard: ModelShard | None = None) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size,
                                       REPLICATED if shard is None else shard.vocab(shard.embedding))
        self.layers = nn.ModuleList(DecoderLayer(config, i, quantization, shard)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str | None = None, shard: ModelShard | None = None) -> None:
        """The model of `config`, or a tensor-parallel rank's part (`self.config`: the rank's shape)."""
        super().__init__()
        self.config = config if shard is None else shard.model_config(config)
        self.quantization = quantization
        self.model = LlamaBody(self.config, quantization, shard)
        self.rotary = Rotary(self.config)
        self.lm_head = _lm_head(self.config, self.model.embed_tokens,
                                REPLICATED if shard is None else shard.vocab(shard.lm_head))
        # a reduced vocabulary (`keep_vocab`): the ids [N] whose rows lm_head holds; None: all
        self.kept_ids: torch.Tensor | None = None
        self.tie_weights()
        # hidden states an EAGLE head reads, left by every forward (capture.py); None: none
        self.capture: HiddenCapture | None = None
        self.compiled = CompiledKernels()  # its fused bundle, compiled at first use (the GPU's fixed shapes)

    def tie_weights(self) -> None:
        """lm_head shares the embedding matrix when the config ties them (call again after
        `to_empty`); a head reading the embedding through its method has no matrix to tie."""
        if (self.config.tie_word_embeddings and isinstance(self.model.embed_tokens, nn.Embedding)
                and self.lm_head.method.checkpoint_params and self.kept_ids is None):
            self.lm_head.weight = self.model.embed_tokens.weight

    def linears(self) -> dict[str, LinearBase]:
        """Every linear layer by its module name (model.layers.0.self_attn.qkv_proj, lm_head)."""
        return linear_layers(self)

    def checkpoint_parts(self) -> PartFn:
        """part(Hugging Face name, whole shape): the part of that tensor this model holds (None: all)."""
        settings = {name: m.parallel for name, m in self.named_modules()
                    if isinstance(m, (LinearBase, VocabParallelEmbedding))}

        def part(hf_name: str, shape: tuple[int, ...]) -> TensorPart | None:
            module = hf_to_fused(hf_name, self.config)[0].rpartition(".")[0]
            parallel = settings.get(module)
            return None if parallel is None else parallel.part(hf_name, shape)

        return part

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, view: AttentionView,
                      kernels: Kernels = EAGER) -> torch.Tensor:
        """input_ids, positions: [B, T] -> final normed hidden states [B, T, H]."""
        # (a NO_TOKEN id, -1, of a faulted request still in flight reads row 0: its output is dropped)
        x = self.model.embed_tokens(input_ids.clamp(min=0))
        cos, sin = cos_sin(positions, self.rotary.inv_freq, x.dtype)
        capture = self.capture
        states: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if capture is not None and i in capture.points:
                states[i] = x
            x = layer(x, cos, sin, view, kernels)
        out = kernels.rmsnorm(x, self.model.norm.weight, self.model.norm.eps)
        if capture is not None:
            states[len(self.model.layers)] = out
            capture.store(states)
        return out

    def logits(self, hidden: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """Logits [..., V] of final normed hidden states [..., H]; -inf outside a reduced vocabulary."""
        out = kernels.linear(self.lm_head, hidden, None)
        return out if self.kept_ids is None else spread_logits(out, self.kept_ids, self.config.vocab_size)

    def keep_vocab(self, ids: torch.Tensor) -> None:
        """Compute logits only for the distinct ids `ids` [N] (a draft's reduced vocabulary):
        lm_head becomes a gathered [N, H] copy (`head_quantization`), `logits` -inf elsewhere."""
        if self.kept_ids is not None:
            raise ValueError("this model's vocabulary is reduced already")
        ids = ids.to(device=self.model.norm.weight.device, dtype=torch.long)
        if ids.ndim != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"a kept vocabulary is 1..{self.config.vocab_size} ids in 0..{self.config.vocab_size - 1}")
        if len(torch.unique(ids)) != len(ids):
            raise ValueError("a kept vocabulary's ids must be distinct")
        self.lm_head = gathered_head(self.lm_head, ids, self.model.norm.weight.dtype,
                                     head_quantization(self.quantization))
        self.kept_ids = ids

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]; default 0..T-1
        view: AttentionView | None = None,  # default: no cache, causal
        logits_indices: torch.Tensor | None = None,  # [B]: only these tokens' logits
        kernels: Kernels = EAGER,  # self.compiled.get() on the fixed-shape GPU paths
    ) -> torch.Tensor:
        """Logits [B, T, V], or [B, V] for one token per row when logits_indices is given."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.hidden_states(input_ids, positions, view or NoCacheView(), kernels)
        if logits_indices is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_indices]
        return self.logits(h, kernels)

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face named tensors in (each linear layer converts or quantizes what it
        reads); raises ValueError if any is missing, extra or misshapen."""
        own = dict(self.named_parameters(remove_duplicate=False))
        linears = self.linears()
        seen: set[str] = set()
        fp8_weights: set[str] = set()  # stored in FP8 by the checkpoint: their scale must come too
        for hf_name, tensor in tensors:
            name, offset = hf_to_fused(hf_name, self.config)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some exports store the tied copy too
            if hf_name.endswith("rotary_emb.inv_freq") or hf_name.endswith(IGNORED_SUFFIXES):
                continue  # older exports store the (recomputed) rotary table; activation scales
            module, _, leaf = name.rpartition(".")
            layer = linears.get(module)
            if layer is not None and leaf in ("weight", "weight_scale", "bias"):
                rows = _fused_rows(hf_name, self.config) if offset is not None else layer.out_features
                if leaf == "weight":
                    layer.load_rows(tensor, offset, hf_name)
                    if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float8_e4m3fn:
                        fp8_weights.add(hf_name)
                elif leaf == "bias":
                    layer.load_bias(tensor, offset, hf_name)
                else:
                    layer.load_scale(tensor, offset, rows, hf_name)
                seen.add(hf_name)
                continue
            param = own.get(name)
            if param is None or not isinstance(tensor, torch.Tensor):
                raise ValueError(f"checkpoint has unexpected tensor {hf_name!r} for this "
                                 f"{self.config.model_type} config")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, but config.json implies "
                    f"{tuple(param.shape)}: the weights do not match this config")
            with torch.no_grad():
                param.data.copy_(tensor)
            seen.add(hf_name)
        expected = [hf for name, p in self._checkpoint_params() for hf, _ in fused_to_hf(name, p, self.config)]
        missing = [hf for hf in expected if hf not in seen]
        missing += sorted(f"{hf}_scale" for hf in fp8_weights if f"{hf}_scale" not in seen)
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]!r}: "
                "the weight files are incomplete (re-download or re-save the model)")

    def _checkpoint_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, parameter) a checkpoint supplies: not the ones a layer derives (FP8 scales);
        an integer layer's codes under `<layer>.weight`."""
        linears = self.linears()
        for name, param in self.named_parameters():
            module, _, leaf = name.rpartition(".")
            layer = linears.get(module)
            if layer is None or leaf in layer.checkpoint_params():
                yield (f"{module}.weight" if layer is not None and leaf == "qweight" else name), param

    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This model's weights under Hugging Face names (fused matrices split; quantized
        layers dequantized to the model's dtype)."""
        linears = self.linears()
        dtype = self.model.norm.weight.dtype
        for name, param in self._checkpoint_params():
            module, _, leaf = name.rpartition(".")
            if module in linears and leaf == "weight":
                param = linears[module].dense_weight(dtype)
            yield from fused_to_hf(name, param.detach(), self.config)


def norm_weights(model: nn.Module) -> set[int]:
    """ids of the model's RMSNorm weights (dummy weights and training set them apart)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}


_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")
# compressed-tensors FP8 checkpoints may store static activation scales: activations stay in bf16
IGNORED_SUFFIXES = (".input_scale", ".output_scale")


def _fused_rows(hf_name: str, config: ModelConfig) -> int:
    """Rows of the fused matrix that a q/k/v or gate/up tensor fills."""
    part = hf_name.split(".")[-2]
    if part in _GATE_UP:
        return config.intermediate_size
    return config.q_size if part == "q_proj" else config.kv_size


def hf_to_fused(hf_name: str, config: ModelConfig) -> tuple[str, int | None]:
    """Map an HF tensor name to (our parameter name, row offset inside a fused matrix)."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _QKV:
        offsets = {"q_proj": 0, "k_proj": config.q_size, "v_proj": config.q_size + config.kv_size}
        return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), offsets[parts[-2]]
    if len(parts) >= 2 and parts[-2] in _GATE_UP:
        offsets = {"gate_proj": 0, "up_proj": config.intermediate_size}
        return ".".join(parts[:-2] + ["gate_up_proj", parts[-1]]), offsets[parts[-2]]
    return hf_name, None


def fused_to_hf(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A parameter under Hugging Face names: a fused matrix's (or bias's) parts, split."""
    prefix, module, leaf = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
    if module == "qkv_proj":
        sizes = [config.q_size, config.kv_size, config.kv_size]
        for part, chunk in zip(_QKV, tensor.split(sizes), strict=True):
            yield f"{prefix}.{part}.{leaf}", chunk
    elif module == "gate_up_proj":
        for part, chunk in zip(_GATE_UP, tensor.split(config.intermediate_size), strict=True):
            yield f"{prefix}.{part}.{leaf}", chunk
    else:
        yield name, tensor
