"""Opening what ``qkmonitor scan`` reads: Hugging Face model folders and Lightning checkpoints,
without building a model and without running any pickle.

A Hugging Face folder is its ``config.json`` and its weights: ``model.safetensors``, sharded
safetensors with their ``model.safetensors.index.json``, or ``pytorch_model.bin`` (and its
sharded index). Safetensors are opened memory-mapped (``safetensors.safe_open``): a tensor is read
only when asked for, so a scan holds one layer's query and key weights at a time. A ``.bin`` or
``.ckpt`` file is read with ``torch.load(weights_only=True, mmap=True)``: tensors and plain values
only, its storage mapped rather than read.

Each path given is one model at one step (:func:`expand`): a Trainer folder ``checkpoint-N`` at
step N, a Lightning checkpoint at its ``global_step``, anything else at its position among the
paths; a folder holding such checkpoints is expanded in step order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["ModelFiles", "ScanError", "TensorSource", "expand", "iter_models", "open_model"]

_SAFETENSORS = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_EXPECTED = (
    "expected a Hugging Face model folder (config.json with model.safetensors, sharded "
    "safetensors and model.safetensors.index.json, or pytorch_model.bin), a Trainer "
    "checkpoint-N folder, a Lightning .ckpt file, or a folder holding checkpoints"
)


class ScanError(ValueError):
    """What a scan cannot read, in one line: the path and what was expected."""

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)


class TensorSource:
    """A model's tensors by name, read one at a time.

    Args:
        files: tensor name -> the safetensors file holding it; or None.
        state: tensor name -> tensor (a ``.bin``/``.ckpt`` state dict, storage memory-mapped).
    """

    def __init__(
        self, files: dict[str, Path] | None = None, state: dict[str, Tensor] | None = None
    ) -> None:
        self._files = dict(files or {})
        self._state = dict(state or {})
        self._handles: dict[Path, Any] = {}

    def names(self) -> list[str]:
        return [*self._files, *self._state]

    def state_items(self) -> list[tuple[str, Tensor]]:
        """The tensors held as a state dict (a ``.bin`` or ``.ckpt``), by name."""
        return list(self._state.items())

    def __contains__(self, name: str) -> bool:
        return name in self._files or name in self._state

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._state:
            return tuple(self._state[name].shape)
        return tuple(self._handle(self._files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> Tensor:
        """The tensor ``name``, read from its file now (the only read of its data; the handles
        kept open serve the names and shapes, read from the header alone)."""
        if name in self._state:
            return self._state[name]
        path = self._files[name]
        from safetensors import SafetensorError

        try:  # a mapping of its own, unmapped once read: pages a handle kept mapped would stay
            with _safe_open(path) as handle:  # resident (counted in the process's memory)
                return handle.get_tensor(name)
        except (SafetensorError, OSError) as err:  # a file cut or changed since it was opened
            raise ScanError(path, f"cannot read tensor {name!r}: {err}") from None

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = _safe_open(path)
        return handle


@dataclass
class ModelFiles:
    """One model to scan: where it is, at which step, its config and its tensors.

    Attributes:
        path: as given (or found in a folder of checkpoints).
        step: the step it is written at.
        config: the Hugging Face ``config.json`` (or a Lightning checkpoint's hyper-parameters).
        tensors: its tensors by name.
        kind: ``"hf"`` (a Hugging Face folder) or ``"lightning"`` (a ``.ckpt`` file).
    """

    path: Path
    step: int
    config: dict[str, Any]
    tensors: TensorSource
    kind: str = "hf"
    extra: dict[str, Any] = field(default_factory=dict)


def expand(paths: Sequence[str | Path]) -> list[tuple[Path, int | None]]:
    """Each model of ``paths`` with its step where the path tells it (``checkpoint-N``), in step
    order within a folder of checkpoints; ``None``: a ``.ckpt`` (its ``global_step``, read when
    opened) or the position among the paths.

    Raises:
        ScanError: a path that does not exist, or a folder that is neither a model nor holds any.
    """
    out: list[tuple[Path, int | None]] = []
    for given in map(Path, paths):
        if not given.exists():
            raise ScanError(given, f"no such file or folder; {_EXPECTED}")
        if given.is_file() or (given / "config.json").is_file():
            out.append((given, _trainer_step(given)))
            continue
        found = _checkpoints_in(given)
        if not found:
            raise ScanError(given, f"holds no config.json and no checkpoints; {_EXPECTED}")
        out.extend(found)
    return out


def open_model(path: Path, step: int | None, position: int) -> ModelFiles:
    """Open one model: a Hugging Face folder or a Lightning checkpoint.

    Raises:
        ScanError: no weights beside the config, a file that is not a checkpoint, a corrupt one.
    """
    if path.is_file():
        return _open_checkpoint(path, position)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ScanError(path / "config.json", f"not a readable JSON config: {err}") from None
    if not isinstance(config, dict):
        raise ScanError(path / "config.json", "expected a JSON object (a model's config)")
    tensors = _hf_tensors(path)
    return ModelFiles(path, position if step is None else step, config, tensors)


def _trainer_step(path: Path) -> int | None:
    match = _CHECKPOINT.match(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def _checkpoints_in(folder: Path) -> list[tuple[Path, int | None]]:
    """The Trainer ``checkpoint-N`` folders and Lightning ``.ckpt`` files in ``folder``, in step
    order (a ``.ckpt`` by its ``global_step``)."""
    found: list[tuple[int, str, Path, int | None]] = []
    for child in folder.iterdir():
        step = _trainer_step(child)
        if step is not None and (child / "config.json").is_file():
            found.append((step, child.name, child, step))
        elif child.is_file() and child.suffix == ".ckpt":
            found.append((_checkpoint_step(child), child.name, child, None))
    return [(path, step) for _, _, path, step in sorted(found)]


def _checkpoint_step(path: Path) -> int:
    checkpoint = _load(path)
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    return step if isinstance(step, int) else 0


def _hf_tensors(folder: Path) -> TensorSource:
    if (folder / _SAFETENSORS_INDEX).is_file():
        return TensorSource(files=_indexed(folder, folder / _SAFETENSORS_INDEX))
    if (folder / _SAFETENSORS).is_file():
        path = folder / _SAFETENSORS
        return TensorSource(files=dict.fromkeys(_safe_open(path).keys(), path))
    if (folder / _BIN_INDEX).is_file():
        shards = sorted(set(_indexed(folder, folder / _BIN_INDEX).values()))
        return TensorSource(state={k: v for s in shards for k, v in _state_of(s).items()})
    if (folder / _BIN).is_file():
        return TensorSource(state=_state_of(folder / _BIN))
    raise ScanError(
        folder,
        f"holds config.json but no weights; expected {_SAFETENSORS}, {_SAFETENSORS_INDEX} with "
        f"its shards, or {_BIN}",
    )


def _indexed(folder: Path, index: Path) -> dict[str, Path]:
    """tensor name -> shard file, from a sharded checkpoint's index."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {str(name): folder / str(shard) for name, shard in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ScanError(index, f"not a sharded checkpoint's index (a weight_map): {err}") from None
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise ScanError(shard, f"missing: {index.name} names it as a shard")
    return files


def _safe_open(path: Path) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:  # a truncated or corrupt file
        raise ScanError(
            path, f"not a readable safetensors file (truncated or corrupt?): {err}"
        ) from None


def _load(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True``: tensors and plain values, no pickled code."""
    for mmap in (True, False):  # the legacy (non-zip) format cannot be memory-mapped
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as err:
            if mmap and "mmap" in str(err):
                continue
            raise ScanError(path, _unreadable(path, err, "")) from None
        except Exception as err:  # noqa: BLE001 -- an unpickling error names what it refused
            raise ScanError(path, _unreadable(path, err, " (weights only)")) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _unreadable(path: Path, err: BaseException, how: str) -> str:
    """Why ``torch.load`` could not read ``path``: what the file is where its first bytes begin
    no torch checkpoint (the legacy reader's error then names a pickle opcode it met, ``101``
    for a text file's ``e``, which says nothing), else the first line of ``err``."""
    instead = _not_a_checkpoint(path)
    if instead is not None:
        return f"not a torch checkpoint: {instead}"
    return f"not a readable torch checkpoint{how}: {_first_line(err)}"


def _not_a_checkpoint(path: Path) -> str | None:
    """What ``path`` holds instead of a torch checkpoint, judged by its first bytes, or None where
    they begin one: a zip archive (``torch.save``'s format) or a pickle (the legacy one)."""
    try:
        with open(path, "rb") as file:
            head = file.read(64)
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    if not head:
        return "the file is empty"
    if head.startswith((b"PK\x03\x04", b"\x80")):
        return None
    neither = "neither a zip archive (torch.save's format) nor a pickle"
    text = head.decode("utf-8", "replace").rstrip("\ufffd")  # a character cut at the 64th byte
    if text and "\ufffd" not in text and all(c.isprintable() or c.isspace() for c in text):
        return f"its first bytes are text ({text[:24]!r}), {neither}"
    return f"its first bytes ({head[:8].hex(' ')}) are {neither}"


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _state_of(path: Path) -> dict[str, Tensor]:
    state = _load(path)
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ScanError(path, "expected a state dict (tensor name -> tensor)")
    return state


def _open_checkpoint(path: Path, position: int) -> ModelFiles:
    if path.suffix != ".ckpt":
        raise ScanError(path, f"a file, not a Lightning .ckpt; {_EXPECTED}")
    checkpoint = _load(path)
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ScanError(path, "not a Lightning checkpoint: it holds no `state_dict`")
    step = checkpoint.get("global_step")
    hparams = checkpoint.get("hyper_parameters") or {}
    return ModelFiles(
        path,
        step if isinstance(step, int) else position,
        dict(hparams) if isinstance(hparams, dict) else {},
        TensorSource(state={k: v for k, v in state.items() if isinstance(v, Tensor)}),
        kind="lightning",
    )


def iter_models(paths: Sequence[str | Path]) -> Iterator[ModelFiles]:
    """The models of ``paths`` opened one after another, each at its step."""
    for position, (path, step) in enumerate(expand(paths)):
        yield open_model(path, step, position)
