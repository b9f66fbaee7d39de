"""The ``factor`` conversion streamed layer by layer, in bounded memory (docs/design.md §Streaming).

No whole model is ever built. Token windows (calibration, held-out, evaluation, a cache probe) enter as embedding
rows and travel through the layers as hidden-state streams ``[N, T, hidden]`` (float32):

* **Pass 1** (source): per layer, read its tensors one at a time, run every stream through the source layer
  (calibration windows in bfloat16 autocast unless ``--calib-precision float32``; the others in float32),
  accumulate the statistics of its attention input, keep the held-out (and refit) attention inputs/outputs, and
  build its RoPE plan and weighted K/V matrix, saved to the work folder. Ranks (``--cache-budget``) and the shared
  ``qk_nope_head_dim`` are fixed once pass 1 ends.
* **Pass 2** (converted): per layer, factor, assemble (and reduce the NoPE width, ``--qk-nope-head-dim``), refit
  ``o_proj``, round to the output dtype, measure the held-out attention error, run the converted streams through
  the MLA layer (refit and plain variants when a refit is in play) and write its attention tensors. A sequential
  refit fits on the converted model's own attention inputs: its calibration windows travel through the converted
  layers as written.
* **Finish**: the final norm and LM head score every stream (vocabulary in chunks), the refit is kept or dropped on
  the held-out loss, the checkpoint is written shard by shard (MLP, norms, embeddings copied in the output dtype).

Peak memory: one layer in float32 (and its factorization's float64 matrices), the streams, the embedding/LM-head
matrix while used, one output shard (docs/factor.md §Memory). ``--resume`` continues after the last finished step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mla_convert.convert.layer.converter import (
    LayerConverter,
    Planned,
    RefitInputs,
    plan_step,
)
from mla_convert.convert.layer.factorize import spectrum
from mla_convert.convert.layer.layers import (
    SourceLayers,
    attention_weights,
    check_fits,
    check_head_range,
    embed_windows,
    layer_prefix,
    lm_head,
    run_attention,
    run_mla,
)
from mla_convert.convert.layer.steps import (
    layer_ranks,
    layer_record,
    mla_config,
    plan_and_target,
)
from mla_convert.convert.options.options import ConvertOptions, geometry, refit_stride
from mla_convert.convert.pipeline.device import (
    bfloat16_autocast,
    large_layers,
    resolve_device,
    resolve_dtype,
    trim_heap,
)
from mla_convert.convert.pipeline.layer_files import LayerFiles
from mla_convert.convert.pipeline.records import ProgressFn, Streamed, Texts, streamed_record
from mla_convert.convert.pipeline.workdir import load_torch, mark_done, parked, save_torch
from mla_convert.convert.stats.calibration import HeldOut, LayerStats, StatsAccumulator
from mla_convert.metrics import EvalResult, head_scores
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import latent_cache_bytes
from mla_convert.sources.checkpoint import SourceModel


class StreamedConversion:
    """One streamed conversion in a work folder (see the module docstring).

    Args:
        src: the opened, checked source.
        options: checked conversion options (``options.dtype``/``options.device`` decide the output dtype and
            where layers run).
        texts: the token windows.
        work: the work folder (:mod:`mla_convert.convert.pipeline.workdir`).
        progress: ``(stage, advance, total)`` callback.
        keep_stats: keep every layer's calibration statistics in :attr:`stats` (with the refit's calibration
            inputs and source outputs when a refit is in play), for the oracles and benchmarks
            (:mod:`mla_convert.convert.pipeline.build`); held in memory, not resumable.
        trim: hand freed heap pages back after each layer (:func:`trim_heap`; its ``gc.collect`` costs ~0.1-1 s
            in a process holding many objects, so an in-memory conversion of a small model turns it off).
        resumable: record the streams and the last finished step after each layer (``--resume``); an in-memory
            conversion skips it.
        rope_candidates: RoPE pairs to measure on this source (:mod:`mla_convert.convert.pipeline.rope_split`; the first
            pass records their spectra, :func:`~mla_convert.convert.pipeline.rope_split.choose_rope_pairs` picks one);
            empty: ``options.rope_pairs`` as given.
        rope_strategies: the other rope strategies to measure at the pairs chosen (with ``rope_candidates``).
        refit_modes: the other ``o_proj`` refit modes to measure at the split chosen (with ``rope_candidates``):
            pass 1 then keeps what each mode fits on (the source's refit inputs for ``teacher``, the refit windows
            for ``sequential``).
    """

    def __init__(
        self,
        src: SourceModel,
        options: ConvertOptions,
        texts: Texts,
        work: Path,
        progress: ProgressFn | None = None,
        keep_stats: bool = False,
        trim: bool = True,
        resumable: bool = True,
        rope_candidates: tuple[int, ...] = (),
        rope_strategies: tuple[str, ...] = (),
        refit_modes: tuple[str, ...] = (),
    ) -> None:
        self.src = src
        self.trim = trim
        self.resumable = resumable
        self.rope_candidates = rope_candidates if len(rope_candidates) > 1 else ()
        self.rope_strategies = rope_strategies if self.rope_candidates else ()
        self.refit_modes = refit_modes if self.rope_candidates else ()
        self.options = options
        self.texts = texts
        self.work = work
        self.progress = progress or (lambda stage, n, total: None)
        self.device = resolve_device(options.device)
        self.dtype = resolve_dtype(options.dtype, src)
        self.files = LayerFiles(work, src, self.dtype)
        modes = {options.refit_o_proj, *self.refit_modes}
        #: pass 1 keeps the source's attention inputs on the refit windows (a teacher-forced refit fits on them)
        self.keep_teacher_inputs = "teacher" in modes
        #: pass 1 starts the refit windows' converted stream (a sequential refit fits on the converted inputs)
        self.keep_refit_windows = "sequential" in modes
        self.n_layers = src.num_layers
        self.state: dict[str, Any] = {}
        self.keep_stats = keep_stats
        self.stats: list[LayerStats] = []
        #: the layers are large enough for the heap handling (:func:`large_layers`)
        self.large_layers = large_layers(src.hidden_size, src.intermediate_size)

    @property
    def refit(self) -> bool:
        """Whether the conversion refits ``o_proj`` (``options.refit_o_proj``, which the search may change)."""
        return self.options.refit_o_proj != "none"

    @property
    def sequential(self) -> bool:
        """The refit fits on the converted model's own attention inputs (pass 2 carries the refit windows)."""
        return self.options.refit_o_proj == "sequential"

    # ------------------------------------------------------------------ helpers
    def trim_memory(self, candidate: bool = False) -> None:
        """Hand freed heap pages back (:func:`trim_heap`) where the conversion was made with ``trim``; after one
        search candidate's layer (``candidate``) only where the layers are large (:func:`large_layers`: dozens of
        trims a layer cost more than they save on small ones)."""
        if self.trim and (not candidate or self.large_layers):
            trim_heap()

    def load_state(self) -> None:
        """The state a stopped conversion saved in the work folder (``--resume``)."""
        self.state = load_torch(self.work / "state.pt")

    def save_state(self, step: dict[str, Any]) -> None:
        if not self.resumable:  # an in-memory conversion: nothing resumes it
            return
        save_torch(self.work / "state.pt", self.state)
        mark_done(self.work, step)

    def layer_file(self, i: int, suffix: str) -> Path:
        """Layer ``i``'s file in the work folder (:meth:`LayerFiles.path`)."""
        return self.files.path(i, suffix)

    # ------------------------------------------------------------------ pass 1: source
    def pass_one(self, start: int) -> None:
        """Source streams, statistics, plans and weighted K/V matrices of layers ``start..L-1``."""
        src, st = self.src, self.state
        layers = SourceLayers(src, self.device)
        if start == 0:
            check_head_range(src, self.dtype)
            emb = embed_windows(src, self.texts, self.dtype, self.device)
            st.update(
                streams={f"src_{k}": v for k, v in emb.items()}
                | {f"mla_{k}": self.as_written(v) for k, v in emb.items() if k != "calib"},
                spectra=[],
                d_nope=[],
                cache_source=[],
                timings=[{} for _ in range(self.n_layers)],
            )
            if self.keep_refit_windows:  # the refit windows, to travel through the converted layers in pass 2
                stride = refit_stride(*emb["calib"].shape[:2])
                st["streams"]["mla_refit"] = self.as_written(emb["calib"][::stride])
        for i in range(start, self.n_layers):
            self._source_layer(layers, i)  # which releases the layer's mapped pages once read
            if i == self.n_layers - 1:  # spent: the search and pass 2 read the calibration data from the work folder
                for k in ("src_calib", "src_probe"):
                    st["streams"].pop(k, None)
            self.trim_memory()
            self.save_state({"pass": 1, "layer": i})
            self.progress("calibrate", 1, self.n_layers)

    def _source_layer(self, layers: SourceLayers, i: int) -> None:
        src, st = self.src, self.state
        s = st["streams"]
        t0 = time.perf_counter()
        source = self.files.source_tensors(i)
        prefix = layer_prefix(i)
        for name, tensor in source.items():
            if not name.startswith("self_attn."):  # copied as they are: the MLP and the norms
                check_fits(prefix + name, tensor, self.dtype)
        if src.gguf_file is not None:  # dequantize once: pass 2 and 3 read the float32 copy
            from safetensors.torch import save_file

            save_file(source, str(self.layer_file(i, "src.safetensors")))
        layer = layers.layer(i, source)
        weights = attention_weights(self.src, i, source)
        del source
        src.release()  # read: the layer's mapped source pages leave the resident set before its forwards
        acc = StatsAccumulator(weights, src.num_heads, src.num_kv_heads, src.head_dim, self.device)
        kept_x: list[torch.Tensor] = []
        kept_out: list[torch.Tensor] = []

        stride = refit_stride(*s["src_calib"].shape[:2])
        seen = [0]  # calibration windows before this chunk

        def calib(x: torch.Tensor, out: torch.Tensor) -> None:
            acc.add(x)
            if self.refit:  # every stride-th calibration window: REFIT_TOKENS spread like the statistics
                rows = [j for j in range(x.shape[0]) if (seen[0] + j) % stride == 0]
                seen[0] += x.shape[0]
                if rows:
                    if self.keep_teacher_inputs:  # a sequential refit reads the converted inputs instead
                        kept_x.append(x[rows].detach().float().cpu())
                    kept_out.append(out[rows].detach().float().cpu())

        held_x: list[torch.Tensor] = []
        held_out: list[torch.Tensor] = []

        def held(x: torch.Tensor, out: torch.Tensor) -> None:
            held_x.append(x.detach().float().cpu())
            held_out.append(out.detach().float().cpu())

        with bfloat16_autocast(self.device, enabled=self.options.calib_precision == "bfloat16"):
            s["src_calib"] = layers.run(layer, s["src_calib"], calib)
        s["src_held"] = layers.run(layer, s["src_held"], held)
        s["src_eval"] = layers.run(layer, s["src_eval"])
        from transformers import DynamicCache

        cache = DynamicCache(config=self.src.config)
        s["src_probe"] = layers.run(layer, s["src_probe"], cache=cache)
        st["cache_source"].append(latent_cache_bytes(cache))
        del layer, cache
        t1 = time.perf_counter()
        stats = acc.finish(
            torch.cat(kept_x) if kept_x else None, torch.cat(kept_out) if kept_out else None
        )
        plan, target = plan_and_target(src, self.options, weights, stats)
        if self.keep_stats:
            self.stats.append(stats)
        if self.options.kv_lora_rank is None:
            st["spectra"].append(spectrum(target))
        st["d_nope"].append(int(plan.q_nope.shape[1]))
        if self.rope_candidates:
            self._candidate_spectra(weights, stats)
        st["calib_tokens"] = int(stats.tokens)
        t2 = time.perf_counter()
        save_torch(self.layer_file(i, "plan.pt"), plan)
        save_torch(
            self.layer_file(i, "p1.pt"),
            {
                "target": target,
                "tokens": stats.tokens,
                "x_mean": stats.x_mean,  # with E[x xᵀ] (target.xx): the input moments of a NoPE-width reduction
                "pair_norms": (stats.q_pair_norm, stats.k_pair_norm),  # with the above: the stats again (rope_split)
                "refit": (stats.x, stats.out),
                "held": HeldOut(torch.cat(held_x), torch.cat(held_out)) if held_x else None,
            },
        )
        st["timings"][i].update(source_forward_s=t1 - t0, plan_s=t2 - t1, save_s=time.perf_counter() - t2)

    def _candidate_spectra(self, weights: dict[str, torch.Tensor], stats: LayerStats) -> None:
        """Pass 1, one layer: the singular values of each other RoPE candidate's weighted K/V matrix (the prior's are
        the layer's own, ``state["spectra"]``), for the search (:mod:`mla_convert.convert.pipeline.rope_split`)."""
        split = self.state.setdefault("rope_split", {"spectra": {}})
        for r in self.rope_candidates:
            if r != self.options.rope_pairs:
                planned = plan_step(self.src, self.options.with_split(r), weights, stats)
                split["spectra"].setdefault(r, []).append(spectrum(planned.target))

    # ------------------------------------------------------------------ between passes
    def calibration_record(self, i: int) -> dict[str, Any]:
        """What pass 1 kept of layer ``i`` (``p1.pt``): its weighted K/V matrix ``target``, calibration ``tokens``,
        input mean ``x_mean``, RoPE ``pair_norms``, the refit's ``(x, out)`` and the ``held`` attention pairs."""
        return load_torch(self.layer_file(i, "p1.pt"))

    def stream(self, name: str, copy: bool = False) -> torch.Tensor:
        """A hidden-state stream ``[N, T, hidden]`` where the passes left it (``src_held``: the held-out windows
        after the source's layers; ``mla_held``, ``mla_refit``: the held-out and refit windows entering pass 2),
        read back where the search parked it (:func:`~mla_convert.convert.pipeline.workdir.park`); ``copy``: one the caller owns."""
        s = self.state["streams"]
        if name not in s:
            return parked(self.work, name)  # read anew: already the caller's own
        return s[name].clone() if copy else s[name]

    def prior_spectra(self) -> list[torch.Tensor]:
        """Every layer's singular values under the options pass 1 ran (the prior's)."""
        return self.state["spectra"]

    def candidate_spectra(self) -> dict[int, list[torch.Tensor]] | None:
        """The other RoPE candidates' per-layer singular values (pass 1), None where no search was asked."""
        split = self.state.get("rope_split")
        return None if split is None else split["spectra"]

    def recorded_split(self) -> dict[str, Any] | None:
        """The search's result this conversion adopted before it stopped (a resumed run), else None."""
        return (self.state.get("rope_split") or {}).get("result")

    def adopt(
        self,
        options: ConvertOptions,
        result: dict[str, Any],
        planned: Callable[[int], Planned] | None = None,
        spectra: list[torch.Tensor] | None = None,
    ) -> None:
        """Convert with the search's choice from pass 2 on (between the passes, once): ``options`` (the chosen
        split and levers) and, where its plan is not pass 1's, every layer's plan and weighted K/V matrix
        (``planned(i)``, written into the work folder with their ``spectra``), recorded in the state so a resumed
        conversion does not measure again (:func:`~mla_convert.convert.pipeline.rope_split.choose_rope_pairs`)."""
        if planned is not None and spectra is not None:
            d_nope = []
            for i in range(self.n_layers):
                p1, layer = self.calibration_record(i), planned(i)
                p1["target"] = layer.target
                save_torch(self.layer_file(i, "plan.pt"), layer.plan)
                save_torch(self.layer_file(i, "p1.pt"), p1)
                d_nope.append(int(layer.plan.q_nope.shape[1]))
            self.state["spectra"], self.state["d_nope"] = spectra, d_nope
        self.state.setdefault("rope_split", {"spectra": {}})["result"] = result
        self.options = options

    def ranks_and_config(self) -> MLAConfig:
        """Per-layer ranks (fixed or allocated over every layer's spectrum) and the MLA config."""
        geo = geometry(self.options, self.src)
        ranks = layer_ranks(self.options, self.state["spectra"], geo)
        plans = [load_torch(self.layer_file(i, "plan.pt")) for i in range(self.n_layers)]
        config = mla_config(self.src, self.options, ranks, plans, max(self.state["d_nope"]))
        config.dtype = str(self.dtype).replace("torch.", "")
        return config

    # ------------------------------------------------------------------ pass 2: converted
    def pass_two(self, config: MLAConfig, start: int) -> None:
        """Factor, assemble and refit layers ``start..L-1``; run the held-out streams (plain and refit variants)."""
        st = self.state
        s = st["streams"]
        if start == 0:
            st.update(
                records=[], attn_err={"plain": [], "fit": []}, refit_layers=[], cache_converted=[], lossy_seen=False
            )
            s.pop("src_held", None)  # pass 1's streams are spent; their layer data is in the work folder
            if not self.sequential:
                s.pop("mla_refit", None)  # kept for a sequential refit the search measured and did not choose
            if self.refit:
                s["mla_held_fit"] = s["mla_held"].clone()
        for i in range(start, self.n_layers):
            self._convert_layer(config, i)  # which releases the layer's mapped pages once read
            self.trim_memory()
            self.save_state({"pass": 2, "layer": i})
            self.layer_file(i, "p1.pt").unlink(missing_ok=True)  # spent: the work folder stays ~ one output big
            self.progress("convert", 1, self.n_layers)
        s.pop("mla_refit", None)  # spent: the refit windows are not scored

    def _convert_layer(self, config: MLAConfig, i: int) -> None:
        src, st = self.src, self.state
        s = st["streams"]
        t0 = time.perf_counter()
        p1 = load_torch(self.layer_file(i, "p1.pt"))
        planned = Planned(load_torch(self.layer_file(i, "plan.pt")), p1["target"])
        layer_src = self.files.layer_source(i)
        src.release()  # read: the layer's mapped source pages leave the resident set before its conversion
        refit = None
        if self.refit:
            x, out = p1["refit"]
            refit = RefitInputs(x, out, s["mla_refit"] if self.sequential else None, self.sequential and st["lossy_seen"])
        converted = LayerConverter(self.src, self.options, config, self.device, self.dtype).convert(
            layer_src, planned, refit, p1["x_mean"], p1["held"]
        )
        del layer_src
        layer, attn, fit_w, lossy = converted.layer, converted.attn, converted.fit_w, converted.lossy
        plan, factors, plain_w = converted.plan, converted.factors, layer.self_attn.o_proj.weight.detach().clone()
        t2 = time.perf_counter()
        ho: HeldOut | None = p1["held"]
        variants = {"plain": None, "fit": fit_w} if self.refit else {"plain": None}
        for name, w in variants.items():
            stream = "mla_held" if name == "plain" else "mla_held_fit"
            if w is not None:
                with torch.no_grad():
                    layer.self_attn.o_proj.weight.copy_(w)
            if ho is not None:
                if w is None and name == "fit":
                    err = st["attn_err"]["plain"][-1]  # no refit at this layer: the plain layer
                else:
                    pred = run_attention(layer.self_attn, ho.x.to(self.device), src.num_heads)
                    err = float((pred - ho.out.to(self.device)).norm() / ho.out.norm().clamp_min(1e-30))
                st["attn_err"][name].append(err)
            s[stream] = run_mla(layer, s[stream], src.num_heads, src.intermediate_size)
        if self.sequential:  # the refit windows move on through the layer as written (o_proj: the last variant's)
            s["mla_refit"] = run_mla(layer, s["mla_refit"], src.num_heads, src.intermediate_size, inplace=True)
        if fit_w is not None:
            with torch.no_grad():
                layer.self_attn.o_proj.weight.copy_(plain_w)
        st["lossy_seen"] = st["lossy_seen"] or lossy
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        s["mla_probe"] = run_mla(layer, s["mla_probe"], src.num_heads, src.intermediate_size, cache)
        st["cache_converted"].append(latent_cache_bytes(cache))
        t3 = time.perf_counter()
        self.files.write_attention(i, attn, fit_w)
        st["refit_layers"].append(fit_w is not None)
        st["records"].append(layer_record(i, plan, factors, converted.rounded.fitted))
        st["timings"][i].update(
            convert_s=t2 - t0, held_forward_s=t3 - t2, write_s=time.perf_counter() - t3
        )

    # ------------------------------------------------------------------ refit decision, pass 3
    def head(self) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """The LM head (stored dtype) and the final norms of the source and of the converted model, as written
        (:func:`~mla_convert.convert.layer.layers.lm_head`)."""
        head = lm_head(self.src, self.device, self.dtype)
        self.src.release()  # the table is copied: its mapped pages (1 GB at Llama-3-8B's vocabulary) leave the RSS
        return head

    def decide_refit(self) -> None:
        """Keep the ``o_proj`` refit only if it lowers the converted model's mean next-token loss on the held-out
        windows; records the losses (nats) and the decision in the state."""
        st, s, t = self.state, self.state["streams"], self.texts
        st["variant"], st["refit"] = "", None
        if not any(st["refit_layers"]) or not t.held.numel():
            return
        head, _, mla_norm = self.head()
        _, before = head_scores(s["mla_held"], t.held, mla_norm, head, head_dtype=self.dtype)
        _, after = head_scores(s["mla_held_fit"], t.held, mla_norm, head, head_dtype=self.dtype)
        mb, ma = sum(before) / len(before), sum(after) / len(after)
        st["refit"] = {
            "kept": ma < mb,
            "loss_before": mb,
            "loss_after": ma,
            "window_losses_before": before,
            "window_losses_after": after,
        }
        st["variant"] = "fit" if ma < mb else ""

    def pass_three(self, config: MLAConfig, start: int) -> None:
        """Run the evaluation stream through the converted layers ``start..L-1`` as written (the kept variant)."""
        s = self.state["streams"]
        for i in range(start, self.n_layers):
            t0 = time.perf_counter()
            attn = self.files.read_attention(i, self.kept_fit)
            layer = self.files.written_layer(config, i, attn, self.device)
            s["mla_eval"] = run_mla(layer, s["mla_eval"], self.src.num_heads, self.src.intermediate_size)
            del layer
            self.src.release()
            self.trim_memory()
            self.state["timings"][i]["eval_forward_s"] = time.perf_counter() - t0
            self.save_state({"pass": 3, "layer": i})
            self.layer_file(i, "src.safetensors").unlink(missing_ok=True)
            self.progress("evaluate", 1, self.n_layers)

    def as_written(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the written checkpoint holds it (rounded to the output dtype), back in float32."""
        return t.to(self.dtype).to(torch.float32)

    # ------------------------------------------------------------------ finish
    def score(self) -> EvalResult:
        """Perplexity, KL and top-1 of the converted model against the source on the evaluation windows."""
        s = self.state["streams"]
        head, src_norm, mla_norm = self.head()
        ev, _ = head_scores(
            s["mla_eval"], self.texts.eval, mla_norm, head, (s["src_eval"], src_norm, head), head_dtype=self.dtype
        )
        return ev

    def result(self, config: MLAConfig, ev: EvalResult | None) -> Streamed:
        """Records with the kept variant's attention errors, caches and timings (:func:`~mla_convert.convert.pipeline.records.
        streamed_record`)."""
        return streamed_record(self.state, config, ev, int(self.texts.probe.numel()), self.dtype, self.device)

    @property
    def kept_fit(self) -> bool:
        """Whether the refit ``o_proj`` was kept (:meth:`decide_refit`): the output holds it."""
        return self.state.get("variant") == "fit"

    def layout(self, config: MLAConfig) -> dict[str, torch.Tensor]:
        """Every tensor of the output checkpoint as a meta tensor (:meth:`LayerFiles.layout`)."""
        return self.files.layout(config)

    def loader(self) -> Callable[[str], torch.Tensor]:
        """``name -> tensor`` of the output checkpoint, the kept ``o_proj`` variant (:meth:`LayerFiles.loader`)."""
        return self.files.loader(self.kept_fit)
