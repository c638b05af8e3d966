"""What a process that exports the same model again and again keeps from one export to the next.

The stream's export process (:mod:`train.stream.publish`) writes a delta every few seconds, each
against the same base bundle and each with the dense program of the same graph. Profiled on a
CPU at the full config's table capacities, a delta export spent ~1 s tracing the dense part with
``torch.export`` and ~0.5 s loading the base's ``dense.pt2`` to compare weights, every time, for
a graph and a base that had not changed. This cache keeps both:

- **the traced program**, per graph: a module with the same architecture
  (:class:`~train.model.dense_arch.DenseArchConfig`), the same input names and the same
  parameter and buffer names, shapes and dtypes traces to the same graph, so the program traced
  first is reused with the new weights copied into its ``state_dict`` (and its tensor
  constants that are module buffers) and this call's example inputs as its sample inputs.
  ``torch.export.save`` then writes the bytes a fresh trace would (measured: identical
  ``dense.pt2`` files): the same graph (the digest by which a server updates the weights in
  place, ``serve.program_cache``), the new weight payloads. Anything else (another
  architecture, other inputs, a renamed or reshaped weight) traces again.
- **the base bundle**, per base: :func:`~shared.bundle.read_bundle` (checksums of every file)
  and its program's weights (one ``torch.export.load``, none when this process wrote the
  bundle), keyed by the base's path and its manifest's digest, so a base replaced at the same
  path is read again.

A cache is not shared between processes; one-off exports (``python -m train export``,
``python -m train.tools delta-export``) use a fresh one, which traces. Example::

    cache = ExportCache()
    export_delta(cfg, base=base, out=out_1, checkpoint=ckpt_1, cache=cache)  # traces, reads base
    export_delta(cfg, base=base, out=out_2, checkpoint=ckpt_2, cache=cache)  # reuses both
    cache.traced, cache.reused                                                # 1, 1
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.export import ExportedProgram

from shared.bundle import Bundle, read_bundle
from shared.bundle.reader import read_manifest
from shared.delta import manifest_digest
from train.model.dense_arch import DenseArch, example_inputs, export_dense_arch


@dataclass(frozen=True)
class GraphKey:
    """What decides the graph ``torch.export`` traces of a :class:`DenseArch`."""

    module: str  # class and architecture (the config's repr: every field)
    inputs: tuple[str, ...]  # the program's input names, in order
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) of each weight

    @classmethod
    def of(cls, dense: DenseArch, inputs: tuple[str, ...]) -> GraphKey:
        weights = [*dense.named_parameters(), *dense.named_buffers()]
        tensors = tuple((n, tuple(w.shape), str(w.dtype)) for n, w in weights)
        return cls(f"{type(dense).__qualname__}:{dense.config!r}", inputs, tensors)


def _module_weights(dense: DenseArch) -> dict[str, torch.Tensor]:
    return {**dict(dense.named_parameters()), **dict(dense.named_buffers())}


def _copy(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` of the same kind (a Parameter stays one: the archive records it)."""
    copy = weight.detach().clone()
    if isinstance(weight, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=weight.requires_grad)
    return copy


def _refill(program: ExportedProgram, dense: DenseArch) -> bool:
    """Copy ``dense``'s weights into ``program``'s own tensors; False (nothing copied) when a
    weight of the program has no counterpart of the same shape and dtype in the module."""
    new = _module_weights(dense)
    held = dict(program.state_dict)
    held.update((n, c) for n, c in program.constants.items() if isinstance(c, torch.Tensor))
    # state_dict entries are all module weights; constants may also be lifted literals of the
    # graph (not the module's, the same in every trace of it): those stay as traced
    if any(n not in new for n in program.state_dict):
        return False
    pairs = [(held[n], new[n]) for n in held if n in new]
    if any(o.shape != w.shape or o.dtype != w.dtype for o, w in pairs):
        return False
    with torch.no_grad():
        for old, weight in pairs:
            old.copy_(weight.detach())
    return True


def _weights(program: ExportedProgram) -> dict[str, torch.Tensor]:
    """The tensors of ``program``'s state_dict and constants, by name."""
    held = {**program.state_dict, **program.constants}
    return {n: w for n, w in held.items() if isinstance(w, torch.Tensor)}


class ExportCache:
    """The dense program of the last graph exported and the last base bundle read (module doc).
    Not thread-safe: one export at a time (the stream's export process runs one)."""

    def __init__(self) -> None:
        self._program: tuple[GraphKey, ExportedProgram] | None = None
        self._base: tuple[tuple[str, str], Bundle] | None = None
        self._base_weights: tuple[tuple[str, str], dict[str, torch.Tensor]] | None = None
        self.traced = 0  # programs traced by torch.export
        self.reused = 0  # programs served from the cache with new weights
        self.bases_read = 0  # base bundles read (with their checksums)
        self.base_programs_loaded = 0  # base dense.pt2 loaded to compare weights

    def dense_program(self, dense: DenseArch, *, pairs: bool) -> ExportedProgram:
        """The ``torch.export`` program of ``dense`` (:func:`export_dense_arch` of
        :func:`example_inputs` with ``pairs``), reused with ``dense``'s weights when the last
        program has its graph. The program returned is the cache's: save it before the next
        call, which may overwrite its weights."""
        example = example_inputs(dense, pairs=pairs)
        key = GraphKey.of(dense, tuple(example))
        cached = self._program
        if cached is not None and cached[0] == key and _refill(cached[1], dense):
            program = cached[1]
            if program.example_inputs is not None:
                # this call's example, as a trace would record it (the archive's sample inputs):
                # drawn from the same RNG state, the archive is the bytes a trace would write
                program.example_inputs = ((), {n: example[n] for n in program.example_inputs[1]})
            self.reused += 1
            return program
        program = export_dense_arch(dense, example)
        # the program's weights must not be the module's: the next refill would write into
        # the module of this export, which its caller may still hold
        for held in (program.state_dict, program.constants):
            held.update((n, _copy(w)) for n, w in held.items() if isinstance(w, torch.Tensor))
        self._program = (key, program)
        self.traced += 1
        return program

    def _base_key(self, path: Path) -> tuple[str, str]:
        return str(path.resolve()), manifest_digest(read_manifest(path))

    def base(self, path: Path) -> Bundle:
        """The bundle at ``path`` (:func:`read_bundle`, checksums verified), read again only
        when ``path`` or its manifest changed since the last call."""
        key = self._base_key(path)
        if self._base is None or self._base[0] != key:
            self._base = (key, read_bundle(path))
            self.bases_read += 1
        return self._base[1]

    def base_program_weights(self, bundle: Bundle) -> dict[str, torch.Tensor]:
        """The weights (state_dict and tensor constants) of ``bundle``'s dense program, loaded
        once per base, or not at all when this process wrote the bundle
        (:meth:`wrote_bundle`)."""
        key = self._base_key(bundle.path)
        if self._base_weights is None or self._base_weights[0] != key:
            self._base_weights = (key, _weights(torch.export.load(bundle.dense_program_path)))
            self.base_programs_loaded += 1
        return self._base_weights[1]

    def wrote_bundle(self, path: Path, program: ExportedProgram) -> None:
        """``program`` was saved as the ``dense.pt2`` of the bundle at ``path``: keep copies of
        its weights for the deltas against it (the next :meth:`dense_program` call may
        overwrite the program's own)."""
        copies = {n: w.detach().clone() for n, w in _weights(program).items()}
        self._base_weights = (self._base_key(path), copies)
