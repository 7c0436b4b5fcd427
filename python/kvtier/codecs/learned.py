"""``learned:<name>``: a user's compressor/decompressor pair of ``torch.nn.Module`` s as a codec.

The compressor maps a batch ``[n, layers, 2, kv_heads, block_size, head_dim]`` (fp32) to a
latent ``[n, ...]``; the latent is stored in ``latent_dtype`` (fp16 by default); the
decompressor maps it back. Any pair of modules works — a per-layer linear projection of
``head_dim``, an MLP, a small transformer. :class:`LinearCompressor` /
:class:`LinearDecompressor` are the common case (a per-layer, per-K/V projection to ``rank``
dimensions around a mean, what PCA gives) and the pair :meth:`LearnedCodec.load` rebuilds from
the file alone; for other modules, pass instances to load the weights into.

Weights live in safetensors files (no pickle). A codec's format includes a fingerprint of its
weights, so a payload written by one trained pair is never decoded by another.

This module needs torch (``kvtier.codecs`` imports it on first use).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from .._torch import DTYPES
from ..errors import InvalidArgumentError, require
from .base import BlockShape, Codec, Section

#: ``kvtier.module`` metadata value of the built-in pair.
LINEAR_MODULE = "kvtier.linear"


class LinearCompressor(nn.Module):
    """``x -> (x - mean) @ down`` per (layer, K/V): ``[n, L, 2, H, B, D] -> [n, L, 2, H, B, r]``."""

    def __init__(self, layers: int, head_dim: int, rank: int) -> None:
        super().__init__()
        self.config = {"layers": layers, "head_dim": head_dim, "rank": rank}
        self.down = nn.Parameter(torch.zeros(layers, 2, head_dim, rank))
        self.mean = nn.Parameter(torch.zeros(layers, 2, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - self.mean[None, :, :, None, None, :]
        return torch.einsum("nlkhbd,lkdr->nlkhbr", centered, self.down)


class LinearDecompressor(nn.Module):
    """``z -> z @ up + mean`` per (layer, K/V)."""

    def __init__(self, layers: int, head_dim: int, rank: int) -> None:
        super().__init__()
        self.config = {"layers": layers, "head_dim": head_dim, "rank": rank}
        self.up = nn.Parameter(torch.zeros(layers, 2, rank, head_dim))
        self.mean = nn.Parameter(torch.zeros(layers, 2, head_dim))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = torch.einsum("nlkhbr,lkrd->nlkhbd", z, self.up)
        return x + self.mean[None, :, :, None, None, :]


def linear_pair(layers: int, head_dim: int, rank: int) -> tuple[nn.Module, nn.Module]:
    return LinearCompressor(layers, head_dim, rank), LinearDecompressor(layers, head_dim, rank)


def fit_pca(blocks: torch.Tensor, rank: int) -> tuple[nn.Module, nn.Module]:
    """The best linear pair of ``rank`` for ``blocks`` in mean squared error: per layer and
    K/V, the top principal directions of the head vectors. A good start for further training."""
    if not 1 <= rank <= blocks.shape[-1]:
        raise InvalidArgumentError(f"rank: expected 1..{blocks.shape[-1]}, got {rank}")
    x = blocks.float()
    layers, head_dim = x.shape[1], x.shape[-1]
    comp = LinearCompressor(layers, head_dim, rank)
    decomp = LinearDecompressor(layers, head_dim, rank)
    with torch.no_grad():
        for layer in range(layers):
            for kv in range(2):
                v = x[:, layer, kv].reshape(-1, head_dim)
                mean = v.mean(0)
                _, _, vh = torch.linalg.svd(v - mean, full_matrices=False)
                basis = vh[:rank].T  # [D, r], orthonormal columns
                comp.down[layer, kv] = basis
                decomp.up[layer, kv] = basis.T
                comp.mean[layer, kv] = mean
                decomp.mean[layer, kv] = mean
    return comp, decomp


class LearnedCodec(Codec):
    """A compressor/decompressor pair as a codec, registered as ``learned:<name>``."""

    def __init__(
        self,
        name: str,
        compressor: nn.Module,
        decompressor: nn.Module,
        *,
        latent_dtype: str = "fp16",
    ) -> None:
        if not (isinstance(compressor, nn.Module) and isinstance(decompressor, nn.Module)):
            raise InvalidArgumentError("expected torch.nn.Module compressor and decompressor")
        if latent_dtype not in ("fp16", "bf16", "fp32"):
            raise InvalidArgumentError(
                f"latent_dtype: expected fp16, bf16 or fp32, got {latent_dtype!r}"
            )
        self.short_name = name
        self.name = f"learned:{name}"
        self.compressor = compressor.eval()
        self.decompressor = decompressor.eval()
        self.latent_dtype = latent_dtype
        self._latent: dict[BlockShape, tuple[int, ...]] = {}
        digest = hashlib.blake2b(digest_size=6)
        for module in (compressor, decompressor):
            for key, value in sorted(module.state_dict().items()):
                digest.update(key.encode())
                digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
        self.fingerprint = digest.hexdigest()

    @property
    def format(self) -> str:
        return f"learned/{self.short_name}/{self.fingerprint}/{self.latent_dtype}"

    def latent_shape(self, shape: BlockShape) -> tuple[int, ...]:
        """The latent of one block, found by running the compressor once on zeros."""
        if shape not in self._latent:
            with torch.no_grad():
                probe = torch.zeros((1, *shape.dims), device=self._device())
                latent = self.compressor(probe)
            if latent.dim() < 1 or latent.shape[0] != 1:
                raise InvalidArgumentError(
                    f"codec {self.name!r}: the compressor must keep the batch axis, got "
                    f"{list(latent.shape)} for input {[1, *shape.dims]}"
                )
            self._latent[shape] = tuple(latent.shape[1:])
        return self._latent[shape]

    def sections(self, shape: BlockShape) -> tuple[Section, ...]:
        return (Section("latent", self.latent_dtype, self.latent_shape(shape)),)

    def _device(self) -> torch.device:
        first = next(self.compressor.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def _on(self, device: torch.device) -> None:
        if self._device() != device:
            self.compressor.to(device)
            self.decompressor.to(device)

    def _encode(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        self._on(blocks.device)
        with torch.no_grad():
            latent = self.compressor(blocks.float())
        return {"latent": latent.to(getattr(torch, DTYPES[self.latent_dtype][0]))}

    def _decode(self, parts: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
        latent = parts["latent"]
        self._on(latent.device)
        with torch.no_grad():
            x = self.decompressor(latent.float())
        if tuple(x.shape[1:]) != shape.dims:
            raise InvalidArgumentError(
                f"codec {self.name!r}: the decompressor returned {list(x.shape)}, expected "
                f"[n, {', '.join(map(str, shape.dims))}]"
            )
        return x

    # -- files ----------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write both modules' weights and this codec's settings to a safetensors file."""
        st = require("safetensors.torch", "torch", purpose="saving a learned codec")
        tensors = {}
        for prefix, module in (
            ("compressor", self.compressor),
            ("decompressor", self.decompressor),
        ):
            for key, value in module.state_dict().items():
                tensors[f"{prefix}.{key}"] = value.detach().cpu().contiguous()
        config = getattr(self.compressor, "config", None)
        builtin = isinstance(self.compressor, LinearCompressor) and isinstance(
            self.decompressor, LinearDecompressor
        )
        metadata = {
            "kvtier.codec": "learned",
            "kvtier.name": self.short_name,
            "kvtier.latent_dtype": self.latent_dtype,
            "kvtier.module": LINEAR_MODULE if builtin else "user",
            "kvtier.config": json.dumps(config if builtin else {}),
        }
        st.save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(
        cls,
        path: str | Path,
        compressor: nn.Module | None = None,
        decompressor: nn.Module | None = None,
        *,
        name: str | None = None,
    ) -> LearnedCodec:
        """Read a file written by :meth:`save`. The built-in linear pair is rebuilt from the
        file; for other modules pass freshly constructed ``compressor``/``decompressor``."""
        st = require("safetensors", "torch", purpose="loading a learned codec")
        with st.safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
        if meta.get("kvtier.codec") != "learned":
            raise InvalidArgumentError(f"{path}: not a kvtier learned codec file")
        if compressor is None or decompressor is None:
            if meta.get("kvtier.module") != LINEAR_MODULE:
                raise InvalidArgumentError(
                    f"{path}: holds weights of user modules; pass compressor= and "
                    "decompressor= instances to load them into"
                )
            config = json.loads(meta["kvtier.config"])
            compressor, decompressor = linear_pair(**config)
        for prefix, module in (("compressor", compressor), ("decompressor", decompressor)):
            state = {
                k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")
            }
            try:
                module.load_state_dict(state)
            except RuntimeError as exc:
                raise InvalidArgumentError(
                    f"{path}: weights do not fit the {prefix}: {exc}"
                ) from exc
        return cls(
            name or meta["kvtier.name"],
            compressor,
            decompressor,
            latent_dtype=meta.get("kvtier.latent_dtype", "fp16"),
        )

    def register(self, *, replace: bool = False) -> LearnedCodec:
        """Make this codec available as ``learned:<name>`` (ladders, ``get_codec``)."""
        from .registry import register_codec

        register_codec(self.name, self, replace=replace)
        return self
