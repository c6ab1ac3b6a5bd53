r"""EffectiveRank: how much rank the residual stream and the attention matrices keep.

On a capped slice of each probed forward — the first ``max_probe_sequences`` sequences and
``max_probe_tokens`` tokens:

- ``hidden_erank``: :math:`\mathrm{erank}(X) = \exp(-\sum_i p_i \log p_i)`,
  :math:`p_i = \sigma_i / \sum_j \sigma_j`, of each sequence's block output ``X`` (n x d);
- ``hidden_collapse``: :math:`\|X - \mathbf{1}\bar x^\top\|_F / \|X\|_F` (Dong et al. 2021),
  → 0 under rank collapse;
- ``attn_erank``: erank of each head's attention matrix A (rows of the slice, all keys);
  ``attn_erank_norm`` = ``attn_erank / min(rows, keys)``;
- ``attn_entropy_norm``: the mean normalized row entropy of the same slice.

Values are means over the probe sequences of every call in the window (and over ranks, through
torchmetrics). ``max_probe_sequences`` is a total over ranks: rank r of W measures
``max // W + (r < max % W)`` of its first sequences, so that with a ``DistributedSampler`` (rank r
gets samples r, r + W, ...) the ranks together measure the sequences one process would.

Under context parallelism a rank's block output holds its part of each sequence, whose effective
rank and collapse are not the sequence's: hidden_erank and hidden_collapse are NaN, named once a
run (the attention metrics are refused with the calls, :mod:`qkmonitor.attention.context_parallel`).
"""

from __future__ import annotations

import reprlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from qkmonitor.alerts import MALIGNANT_COLLAPSE_RULE, RANK_COLLAPSE_RULE
from qkmonitor.attention.compiled import add_forward_hooks
from qkmonitor.attention.context_parallel import CONTEXT_PARALLEL, sequence_split_reason
from qkmonitor.attention.probes import ProbeRequest, ProbeResult, recomputing
from qkmonitor.engine.activation import ActivationEngine, Window, placed
from qkmonitor.engine.head_metrics import HeadMetric, measure_heads
from qkmonitor.engine.host import Host
from qkmonitor.engine.publishing import AttentionPattern, Images, Values
from qkmonitor.measures.catalogue import RANK
from qkmonitor.measures.entropies import normalized_entropy
from qkmonitor.measures.metrics import HeadMean
from qkmonitor.measures.ranks import effective_rank, gram_singular_values, hidden_state_metrics
from qkmonitor.measures.sharding import tensor_parallel_ranks
from qkmonitor.output.tags import image_tag
from qkmonitor.validation import check_non_negative_int, check_positive_int

__all__ = ["EffectiveRank"]

BlocksSpec = Sequence[nn.Module] | Callable[[nn.Module], Sequence[nn.Module]]


#: The engine's defaults, declared once (the Lightning callback's signature uses them too): the
#: sequences and tokens of a batch measured, and the heads per layer drawn as attention images.
MAX_PROBE_SEQUENCES, MAX_PROBE_TOKENS, PATTERN_HEADS = 4, 128, 4


class EffectiveRank(ActivationEngine):
    """Logs hidden_erank and hidden_collapse per layer, attn_erank, attn_erank_norm and
    attn_entropy_norm per layer and head, and images of the first probe sequence's attention.

    The block of an attention layer is its parent module (``blocks.3`` for ``blocks.3.attn``), or
    the attention module itself when the parent is a container or the model; ``blocks=``
    overrides it.

    Args:
        max_probe_sequences: sequences of the batch measured, in total over the ranks.
        max_probe_tokens: tokens (query rows) per sequence measured.
        blocks: the modules whose outputs are the residual stream after each layer, in layer
            order (a list, or a function of the model); default: derived from the layers.
        pattern_heads: heads per layer whose attention pattern is logged as an image (0: none).
        head_metrics: per-head metrics of your own, each measured on the same probability slice
            (:class:`~qkmonitor.engine.head_metrics.HeadMetric`) and logged, charted, reported
            and read by the rules as the engine's own, after them.
        **kwargs: ``options`` or the fields of :class:`~qkmonitor.engine.MonitorOptions`.
    """

    monitor = RANK
    default_rules = (RANK_COLLAPSE_RULE, MALIGNANT_COLLAPSE_RULE)

    def __init__(
        self,
        *,
        max_probe_sequences: int = MAX_PROBE_SEQUENCES,
        max_probe_tokens: int = MAX_PROBE_TOKENS,
        blocks: BlocksSpec | None = None,
        pattern_heads: int = PATTERN_HEADS,
        head_metrics: Sequence[HeadMetric] = (),
        **kwargs: Any,
    ) -> None:
        check_positive_int("max_probe_sequences", max_probe_sequences)
        check_positive_int("max_probe_tokens", max_probe_tokens)
        check_non_negative_int("pattern_heads", pattern_heads)
        if not (
            blocks is None
            or callable(blocks)
            or (
                isinstance(blocks, Sequence)
                and not isinstance(blocks, (str, bytes))
                and all(isinstance(block, nn.Module) for block in blocks)
            )
        ):
            raise ValueError(
                "Expected `blocks` to be a list of modules, a function of the model or None, "
                f"got {type(blocks).__name__} {reprlib.repr(blocks)}"
            )
        self.head_metrics = _checked_head_metrics(head_metrics)
        self.own_specs = {m.spec.name: m.spec for m in self.head_metrics}  # before the rules' check
        super().__init__(**kwargs)
        self.max_probe_sequences = max_probe_sequences
        self._probe_sequences = max_probe_sequences  # this rank's share, set at bind
        self.max_probe_tokens = max_probe_tokens
        self.pattern_heads = pattern_heads
        self._blocks_spec = blocks
        self.blocks: list[nn.Module] = []
        self._hooks: list = []
        self._hidden: dict[int, list[Tensor]] = {}
        #: layer -> why its block output in the open window is a rank's part of the sequence
        self._split_hidden: dict[int, str] = {}
        self._mean = HeadMean(1, sync_on_compute=False)  # sized at bind (`_fit`)

    def _request(self) -> ProbeRequest:
        sequences = self._probe_sequences
        return ProbeRequest(
            stats=True, probs_slice=(sequences, self.max_probe_tokens) if sequences else None
        )

    def _prepare(self, model: nn.Module) -> None:
        super()._prepare(model)
        self._probe_sequences = _share_of_this_rank(
            self.max_probe_sequences, tensor_parallel_ranks(model)
        )
        self.blocks = self._find_blocks(model)
        self._batch_first = [getattr(layer.module, "batch_first", True) for layer in self.layers]
        self._fit([layer.num_heads_hint for layer in self.layers])

    def _fit(self, heads: list[int]) -> None:
        """One aggregator for every layer and metric, side by side (one ``compute`` and ``reset`` a
        probe): ``self._columns[i]`` maps each metric of layer i to its slots."""
        self._columns, start = [], 0
        for count in heads:
            columns = {}
            for spec in self.specs:
                width = count if spec.per_head else 1
                columns[spec.name], start = slice(start, start + width), start + width
            self._columns.append(columns)
        self._mean = HeadMean(max(start, 1), sync_on_compute=False)

    def _fit_heads(self, results: list[ProbeResult]) -> None:
        """Layers whose head count only their calls tell (read by interception) get slots of that
        size."""
        heads = [c["attn_erank"].stop - c["attn_erank"].start for c in self._columns]
        observed = []
        for layer, result, count in zip(self.layers, results, heads):
            seen = [t.shape[1] for t in result.probs] + [s.entropy.shape[1] for s in result.stats]
            if result.placement is not None:  # this rank's part of the heads: all of them
                seen = [result.placement.total]
            observed.append(seen[0] if seen and not layer.layout_ready else count)
        if observed != heads:
            self._fit(observed)

    def _find_blocks(self, model: nn.Module) -> list[nn.Module]:
        if self._blocks_spec is not None:
            blocks = list(
                self._blocks_spec(model) if callable(self._blocks_spec) else self._blocks_spec
            )
            if len(blocks) != len(self.layers) or not all(isinstance(b, nn.Module) for b in blocks):
                raise ValueError(
                    "Expected `blocks` to give one module per attention layer "
                    f"({len(self.layers)}), got {[type(b).__name__ for b in blocks]}"
                )
            return blocks
        found = []
        for layer in self.layers:
            parent_name = layer.name.rpartition(".")[0]
            try:
                parent = model.get_submodule(parent_name) if layer.name else model
            except AttributeError:  # a layer given by the user, outside the model's naming
                parent = model
            container = isinstance(parent, (nn.ModuleList, nn.ModuleDict)) or parent is model
            found.append(layer.module if container else parent)
        return found

    def _open_extra(self) -> None:
        self._hidden, self._split_hidden = {}, {}
        self._hooks = [
            add_forward_hooks(block, post=self._hidden_hook(i))
            for i, block in enumerate(self.blocks)
        ]

    def _close_extra(self) -> None:
        hooks, self._hooks = self._hooks, []
        for remove in hooks:
            remove()

    def _probed_modules(self) -> list[nn.Module]:
        return super()._probed_modules() + list(self.blocks)

    def _hidden_hook(self, index: int):
        def hook(module: nn.Module, args, output) -> None:
            x = output[0] if isinstance(output, (tuple, list)) else output
            if recomputing():  # a checkpoint's recomputation in the backward: already kept
                return
            if not isinstance(x, Tensor) or x.dim() not in (2, 3):
                return
            if x.dim() == 2:  # unbatched (N, d)
                x = x[None]
            elif not self._batch_first[index]:  # (N, B, d) -> (B, N, d)
                x = x.transpose(0, 1)
            split = sequence_split_reason(x)
            if split is not None:  # this rank's part of each sequence: refused, never kept
                self._split_hidden.setdefault(index, f"the block output is {split}")
                return
            cut = x[: self._probe_sequences, : self.max_probe_tokens].detach().clone()
            self._hidden.setdefault(index, []).append(cut)

        return hook

    def aggregators(self) -> list[Metric]:
        return [self._mean]

    def _accumulate(self, results: list[ProbeResult], step: int, *, visuals: bool) -> Images:
        """Add the window's samples to the aggregator; the attention images are carried."""
        images: Images = {}
        hidden, self._hidden = self._whole_sequences(self._hidden, results), {}
        self._fit_heads(results)
        # the spectra of every layer's cuts in a few batched calls (layers of one shape together)
        streams = [(i, x) for i in sorted(hidden) for x in hidden[i]]
        stream_metrics = _batched(
            hidden_state_metrics, [x for _, x in streams]
        )  # per cut: (S,), (S,)
        patterns = [
            (i, probs) for i, result in enumerate(results) for probs in result.probs
        ]  # (S, H, R, M)
        pattern_ranks = _batched(
            _attention_erank, [probs for _, probs in patterns]
        )  # per pattern: (S, H)
        slots = self._columns
        samples: list[tuple[slice, Tensor, Tensor | None]] = []
        for (i, x), (erank, collapse) in zip(streams, stream_metrics):
            single = torch.full(collapse[:, None].shape, x.shape[-2] < 2, device=collapse.device)
            samples += [
                (slots[i]["hidden_erank"], erank[:, None], None),
                (slots[i]["hidden_collapse"], collapse[:, None], ~single),
            ]  # one token: undefined, left out
        for (i, probs), (rank,) in zip(patterns, pattern_ranks):
            where = results[i].placement
            samples += [
                (placed(slots[i]["attn_erank"], where), rank, None),
                (placed(slots[i]["attn_erank_norm"], where), rank / min(probs.shape[-2:]), None),
            ]
            samples += [
                (placed(slots[i][m.spec.name], where), measure_heads(m, probs), None)
                for m in self.head_metrics
            ]
        for i, result in enumerate(results):
            first = 0 if result.placement is None else result.placement.offset
            for stats in result.stats:
                s, r = self._probe_sequences, self.max_probe_tokens
                n = stats.attended[:s, :, :r].double()
                norm = normalized_entropy(stats.entropy[:s, :, :r].double(), n)
                keep = (n > 1).any(-1)  # (S, H): a sequence slot with a row that has a value
                columns = placed(slots[i]["attn_entropy_norm"], result.placement)
                samples.append((columns, _mean_rows(norm, n > 1), keep))
            if (
                result.probs and result.probs[0].numel()
            ):  # drawn when published (visuals, or the run's end)
                # (to the host in the probe's one copy: record)
                shown = result.probs[0][0, : max(self.pattern_heads - first, 0)].detach()
                for h, probs in enumerate(shown, start=first):  # h: the head's global index
                    images[image_tag(self.prefix, "attention", i, h)] = AttentionPattern(
                        probs, title=f"layer {i}, head {h}, step {step}, sequence 0"
                    )
        self._update(samples)
        return images

    def _whole_sequences(
        self, hidden: dict[int, list[Tensor]], results: list[ProbeResult]
    ) -> dict[int, list[Tensor]]:
        """The kept block outputs of the layers that hold whole sequences. Under context
        parallelism a rank's block output holds its part of each sequence, and the effective rank
        and collapse of a part are not the sequence's (not a sum of parts, as the statistics of
        rows are): a layer whose attention calls were refused for it, or whose block output was
        seen split along the sequence (the hook), is left out, NaN, named by
        :meth:`close_window`."""
        for i, result in enumerate(results):
            if any(CONTEXT_PARALLEL in why for why in result.sharded):
                self._split_hidden.setdefault(
                    i,
                    f"its attention's keys are split across ranks ({CONTEXT_PARALLEL}), so the "
                    "block output is this rank's part of the sequence",
                )
        return {i: cuts for i, cuts in hidden.items() if i not in self._split_hidden}

    def close_window(self, host: Host) -> Window | None:
        """:meth:`ActivationEngine.close_window`; the layers whose hidden states were this rank's
        part of the sequence (context parallelism) named once a run, on the logging rank: their
        hidden_erank and hidden_collapse are NaN."""
        window = super().close_window(host)
        split, self._split_hidden = self._split_hidden, {}
        if split:
            names = [self.layers[i].name for i in sorted(split)]
            self.warn_once(
                host,
                "hidden:sequence split",
                f"layer(s) {names}: {split[min(split)]}; hidden_erank and hidden_collapse are "
                "measures of whole sequences, never of part of one: they are NaN. This warning "
                "is shown once.",
                logging_rank_only=True,
            )
        return window

    def _values(self, images: Images) -> tuple[Values, dict[str, Any]]:
        values: Values = {m: [] for m in self.metric_names}
        undefined: dict[str, list[Tensor]] = {m: [] for m in self.metric_names}
        notes: dict[str, list[Tensor]] = {}
        with warnings.catch_warnings():  # the states hold every rank's samples (reduced before)
            warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
            means = self._mean.compute().float().reshape(-1)  # one slot: a scalar
        counted = self._mean.count > 0  # no sample (an empty batch, one token): undefined
        self._mean.reset()
        for layer_columns in self._columns:
            for name, columns in layer_columns.items():
                values[name].append(means[columns])
                undefined[name].append(~counted[columns])
            # samples, but none with a value: one-token sequences (said once a run)
            for name, beside in (
                ("hidden_collapse", "hidden_erank"),
                ("attn_entropy_norm", "attn_erank"),
            ):
                none = counted[layer_columns[beside]].any() & ~counted[layer_columns[name]].any()
                notes.setdefault(name, []).append(none)
        return (
            {name: values[name] for name in self.metric_names},
            {
                "images": images,
                "undefined": {name: undefined[name] for name in self.metric_names},
                "notes": notes,
            },
        )

    def _update(self, samples: list[tuple[slice, Tensor, Tensor | None]]) -> None:
        """Add samples, ``(slots, (S, width) values, keep or None)``, to the aggregator: samples
        with the same count S side by side in one update, every layer's at once (one update per
        call that gave them, when a layer ran several times)."""
        rounds: list[dict[tuple[int, int], tuple[slice, Tensor, Tensor | None]]] = []
        for columns, values, keep in samples:
            if values.shape[0] == 0:  # an empty batch: no sample
                continue
            values = values.reshape(values.shape[0], -1)
            key = (columns.start, columns.stop)
            slot = next(
                (
                    r
                    for r in rounds
                    if key not in r and next(iter(r.values()))[1].shape[0] == values.shape[0]
                ),
                None,
            )
            if slot is None:
                rounds.append(slot := {})
            slot[key] = (columns, values, keep)
        aggregate = self._mean
        for parts in rounds:
            first = next(iter(parts.values()))[1]
            block = torch.zeros(
                first.shape[0], aggregate.num_heads, dtype=torch.float64, device=first.device
            )
            kept = torch.zeros(block.shape, dtype=torch.bool, device=first.device)
            for columns, values, keep in parts.values():
                block[:, columns] = values
                kept[:, columns] = True if keep is None else keep.reshape(values.shape)
            if aggregate.device != block.device:
                aggregate.to(block.device)
            aggregate.update(block, kept)


def _checked_head_metrics(head_metrics: Sequence[HeadMetric]) -> tuple[HeadMetric, ...]:
    """``head_metrics`` as a tuple, each a :class:`HeadMetric` and no name twice."""
    if isinstance(head_metrics, HeadMetric) or not all(
        isinstance(m, HeadMetric) for m in head_metrics
    ):
        raise ValueError(
            "Expected `head_metrics` to be a list of qkmonitor.engine.HeadMetric, got "
            f"{reprlib.repr(head_metrics)}"
        )
    names = [m.spec.name for m in head_metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"Expected `head_metrics` with distinct names, got {names}")
    return tuple(head_metrics)


def _share_of_this_rank(total: int, tensor_parallel: int = 1) -> int:
    """This process's part of ``total`` probe sequences: ``total // R``, one more on the first
    ``total % R`` replicas, over the R = W / ``tensor_parallel`` data-parallel replicas (the ranks
    of one tensor-parallel group compute the same sequences, each for its heads: each measures
    its replica's share); all of it without a process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return total
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    replicas = max(world // tensor_parallel, 1)
    replica = rank * replicas // world  # the tensor-parallel groups are runs of ranks
    return total // replicas + int(replica < total % replicas)


def _attention_erank(probs: Tensor) -> tuple[Tensor]:
    """(..., R, M) attention rows -> ((...,) erank,), NaN where a row holds NaN (broken scores).

    The trailing keys no row of any matrix attends (those after the slice's last row under a
    causal mask: half the keys of a 128-row slice of 256 tokens) are left out first: a zero column
    adds nothing to the Gram matrix, so the singular values that are not zero, and the effective
    rank, are the same, for half the products (where the host reads them without waiting:
    :data:`TRIMMED_ON`). A NaN is not zero: its column stays."""
    if probs.device.type in TRIMMED_ON:
        mass = probs.sum(dim=tuple(range(probs.dim() - 1)))  # (M,): 0 only where no row attends
        attended = mass != 0  # (probabilities are >= 0; a NaN sums to NaN, which is not 0)
        keys = int(attended.nonzero().max()) + 1 if bool(attended.any()) else probs.shape[-1]
        probs = probs[..., :keys]
    return (effective_rank(gram_singular_values(probs)),)


#: The devices where :func:`_attention_erank` finds the attended keys first: the CPU, where the
#: host reads them without waiting. On an accelerator that read would make the training step
#: wait; the zero columns cost a product twice the size there instead.
TRIMMED_ON = ("cpu",)


def _batched(
    measure: Callable[[Tensor], tuple[Tensor, ...]], tensors: list[Tensor]
) -> list[tuple[Tensor, ...]]:
    """``[measure(t) for t in tensors]`` in one call per shape: tensors of one shape, dtype and
    device are concatenated along dim 0 (``measure`` works batch-wise along it) and split back."""
    out: list[tuple[Tensor, ...] | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for j, t in enumerate(tensors):
        groups.setdefault((t.shape, t.dtype, t.device), []).append(j)
    for members in groups.values():
        parts = measure(torch.cat([tensors[j] for j in members]))
        sizes = [tensors[j].shape[0] for j in members]
        for j, *split in zip(members, *(part.split(sizes) for part in parts)):
            out[j] = tuple(split)
    return out  # type: ignore[return-value]


def _mean_rows(values: Tensor, keep: Tensor) -> Tensor:
    """(S, H, R) -> (S, H): the mean over the rows ``keep`` selects (rows with more than one key).

    A NaN in a kept row (broken scores) makes the mean NaN; a slot with no kept row is NaN.
    """
    return torch.where(keep, values, 0.0).sum(-1) / keep.sum(-1)
