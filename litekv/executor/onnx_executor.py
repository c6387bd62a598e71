"""ONNX Runtime executor: IO binding with the KV cache bound in place as past and present.

GroupQueryAttention (or litekv's DecodeAttention / PrefillAttention, which keep its contract)
appends the new rows to the bound past buffer and reads only the valid length, so a step costs
the live context, not the capacity. Sampling runs in the companion
`sampler.onnx`, fed from the logits buffer through IO binding.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from litekv import native_attention
from litekv.bundle import HEAD_KEEP_INPUT, ONNX_LORA_FILE, SAMPLER_INPUTS, BundleError, Manifest, check_onnx_graph
from litekv.errors import AcceleratorUnavailable, BackendError, Cancelled, MissingDependency
from litekv.kv_cache import KVCache, aligned_zeros
from litekv.resident_pages import FileMappings, ModelFilePages, mapped_ranges
from litekv.sampling import CANDIDATES

from .base import ExternalSamplerExecutor, InternalSamplerExecutor, SamplerParams, check_accelerator, check_threads
from .lora import LoraAdapter, lora_inputs
from .numpy_executor import host_sample, host_token
from .prefill_plan import Chunk

# accelerator name -> execution providers to try, in order
_PROVIDERS = {
    "cpu": ("CPUExecutionProvider",),
    "gpu": ("CUDAExecutionProvider", "ROCMExecutionProvider", "DmlExecutionProvider", "CoreMLExecutionProvider"),
    "npu": ("QNNExecutionProvider", "OpenVINOExecutionProvider", "VitisAIExecutionProvider"),
}
# ONNX Runtime threads of the decode-step graph of a bundle with litekv's linear ops. Those ops
# share their rows between the caller and litekv's own helper thread, so a pool worker of ONNX
# Runtime spinning between nodes would take the helper's core.
DECODE_GRAPH_THREADS = 1
# Longest chunk per call. 256 beats 512 and 1,024 at a 1,024-token prompt (fp32 830 vs 740 vs 620 tok/s,
# int8 1,260 vs 1,070): the smaller working set stays in cache; it also bounds activation memory.
PREFILL_CHUNK = 256


def _session_options(ort, threads: int):
    """Options with all graph optimizations and `threads` intra-op threads. One thread for the tiny
    sampler graph and for a decode graph on litekv's ops: no worker pool of its own, so nothing
    spins beside the model's pool (whose workers spin between nodes, ONNX Runtime's default) or
    beside litekv's helper thread."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def _ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise MissingDependency("the ONNX backend needs onnxruntime: pip install onnxruntime") from e
    return onnxruntime


def choose_providers(accelerator: str | list) -> tuple[str, list]:
    """(accelerator actually used, provider list) for a name, 'auto', or an explicit provider list."""
    ort = _ort()
    available = ort.get_available_providers()
    if isinstance(accelerator, (list, tuple)):  # explicit [(name, options)] or [name]
        names = [p[0] if isinstance(p, tuple) else p for p in accelerator]
        missing = [n for n in names if n not in available]
        if missing:
            raise AcceleratorUnavailable(", ".join(missing), f"not in this onnxruntime build (it has {available})")
        return names[0], list(accelerator)
    order = ("gpu", "npu", "cpu") if accelerator == "auto" else (accelerator,)
    for kind in order:
        if kind not in _PROVIDERS:
            raise AcceleratorUnavailable(kind, "unknown accelerator; use cpu, gpu, npu, auto or a provider list")
        found = [p for p in _PROVIDERS[kind] if p in available]
        if found:
            return kind, [found[0]] + ([] if kind == "cpu" else ["CPUExecutionProvider"])
    raise AcceleratorUnavailable(accelerator, f"this onnxruntime build offers only {available}")


class OnnxExecutor(ExternalSamplerExecutor, InternalSamplerExecutor):
    backend = "onnx"

    def __init__(self, bundle: str | Path, manifest: Manifest, accelerator: str | list = "cpu",
                 threads: int | None = None):
        super().__init__(manifest.config, manifest.max_context, (PREFILL_CHUNK,), manifest.lora_rank,
                         manifest.lora_targets)
        self.kv_layout = manifest.kv_layout  # BHSD, or BHSD_KB8 where litekv's ops keep the keys in blocks
        check_accelerator("onnx", accelerator, provider_lists=True)  # also when constructed directly
        threads = check_threads(threads) or 2
        ort = self._ort = _ort()
        self.accelerator, providers = choose_providers(accelerator)
        options = _session_options(ort, threads)
        bundle = Path(bundle)
        # Each graph and the external data it names inside the bundle, whoever made the manifest, before ONNX
        # Runtime follows those names.
        model_path = check_onnx_graph(bundle, manifest.model_file, "model file")
        decode_path = (check_onnx_graph(bundle, manifest.decode_model_file, "model file")
                       if manifest.decode_model_file else None)
        sampler_path = (check_onnx_graph(bundle, manifest.sampler_file, "sampler graph")
                        if manifest.sampler_file else None)
        self.bundle_path, self._threads, self._providers = bundle, threads, providers
        self._lora_session = None  # the LoRA graph, opened when the first adapter is loaded
        data_file = bundle / (manifest.model_file + ".data")
        mapped_before = mapped_ranges(data_file)  # other sessions of this file in the process: not ours
        kernel = self._kernel = self._kernels(bundle, manifest, threads)
        try:
            self.session = self._session(model_path, options, kernel)
            # Decode steps run their own graph where it has one (litekv's kernels), else the same.
            self.decode_session = self.session
            if decode_path:
                # one thread where litekv's kernels do the matmuls; ONNX Runtime's own want its pool
                decode_threads = DECODE_GRAPH_THREADS if manifest.decode_linears == "kernel" else threads
                self.decode_session = self._session(decode_path, _session_options(ort, decode_threads), kernel)
            self.sampler = (ort.InferenceSession(str(sampler_path), _session_options(ort, 1), providers=providers)
                            if sampler_path else None)
        except Exception as e:  # onnxruntime raises its own exception types
            if self.accelerator != "cpu":
                raise AcceleratorUnavailable(self.accelerator, str(e)) from e
            raise BackendError(f"onnxruntime could not load {model_path}: {e}") from e
        self._sampler_io = _SamplerBinding(ort, self.sampler) if self.sampler is not None else None
        if self.accelerator == "cpu" and data_file.exists():
            # ONNX Runtime maps each external initializer privately and writable, and runs on its
            # prepacked copies of the weights; it never writes the mappings. Sealed read-only, their
            # pages (packing leftovers and a prefill's embedding rows: 50 MB of the int4 SmolLM2
            # file after a 1,024-token prompt) can be given back like LiteRT's.
            self.model_pages = ModelFilePages(FileMappings(data_file, exclude=mapped_before, seal_unwritten=True))
        self.manifest = manifest

    @staticmethod
    def _kernels(bundle: Path, manifest: Manifest, threads: int):
        """litekv's kernels (linears, attention) for a bundle whose graphs call them, else None."""
        if not manifest.uses_attention_kernel:
            return None
        cfg = manifest.config
        try:
            return native_attention.AttentionKernel(cfg.head_dim, cfg.num_heads, manifest.max_context, threads)
        except MissingDependency as e:
            raise BundleError(f"{bundle}: its graphs run litekv's kernels, and {e}. Or reconvert the model with "
                              "--decode-linears graph --decode-attention graph --prefill-attention graph, which "
                              "need ONNX Runtime's own ops only.") from e

    def _session(self, path: Path, options, kernel):
        if kernel is None:
            return self._ort.InferenceSession(str(path), options, providers=self._providers)
        return kernel.onnx_session(str(path), options, self._providers)

    # ---- caches and bindings -------------------------------------------------------------------
    def create_kv_cache(self, batch_size: int = 1, huge_pages: bool = True) -> KVCache:
        cfg = self.config
        return KVCache.allocate(cfg.num_layers, batch_size, cfg.num_kv_heads, cfg.head_dim, self.max_context,
                                self.kv_layout, self.manifest.kv_dtype, huge_pages=huge_pages)

    def _binding(self, kv_cache: KVCache, row: int, session) -> "_RowBinding":
        """IO binding of one batch row for one graph, with its K/V bound in place (memoized on the cache)."""
        key = (id(self), row, id(session))
        if key not in kv_cache.bindings:
            kv_cache.bindings[key] = _RowBinding(self, session, kv_cache, row, self._run_options(kv_cache))
        return kv_cache.bindings[key]

    def _run_options(self, kv_cache: KVCache) -> "_RunOptions":
        """The RunOptions of every run on `kv_cache` (memoized on the cache): a cancel terminates them."""
        key = (id(self), "run options")
        if key not in kv_cache.bindings:
            kv_cache.bindings[key] = _RunOptions(self._ort)
        return kv_cache.bindings[key]

    def _prepare_adapter(self, adapter: LoraAdapter | None) -> dict[str, np.ndarray]:
        if adapter is None or self.lora_rank is None:
            return {}
        if self._lora_session is None:
            path = check_onnx_graph(self.bundle_path, ONNX_LORA_FILE, "LoRA graph")
            try:
                # options of its own: litekv's ops register once per SessionOptions
                self._lora_session = self._session(path, _session_options(self._ort, self._threads), self._kernel)
            except Exception as e:
                raise BackendError(f"onnxruntime could not load {path}: {e}") from e
        return lora_inputs(adapter, self.config, self.manifest.lora_groups, self.lora_rank, self.manifest.lora_layout)

    def _run(self, tokens: np.ndarray, start: int, kv_cache: KVCache, row: int, adapter: LoraAdapter | None,
             head_keep: int = 0):
        lora_id, lora = self._prepared_inputs(adapter)
        if adapter is not None:
            session = self._lora_session
        else:
            session = self.decode_session if len(tokens) == 1 else self.session
        binding = self._binding(kv_cache, row, session)
        binding.prepare(tokens, start, lora_id, lora or {}, head_keep)
        options = binding.options
        while True:  # a run stopped by a cancel that was not for this call runs again (see _cancelled_on)
            try:
                session.run_with_iobinding(binding.io, options.step if len(tokens) == 1 else options.chunk)
                return binding.logits, binding.logits_value
            except Exception as e:
                if "terminate flag" not in str(e):
                    raise BackendError(f"onnxruntime failed: {e}") from e
                options.renew()
                if self._cancelled_on(kv_cache):
                    raise Cancelled("onnx call cancelled inside the model run.") from e

    # ---- hooks -----------------------------------------------------------------------------------
    def _prefill_sizes(self) -> range:
        """Every length up to PREFILL_CHUNK: the graphs' token axis is dynamic and a chunk runs
        unpadded. Offered PREFILL_CHUNK alone, plan_prefill fits no chunk into fewer free slots
        than that and ran each prompt token as a decode step (every prompt of a bundle with a
        context under 256)."""
        return range(1, PREFILL_CHUNK + 1)

    def _run_prefill_chunk(self, tokens: np.ndarray, chunk: Chunk, kv_cache: KVCache, row: int,
                           adapter: LoraAdapter | None) -> None:
        self._run(tokens, chunk.start, kv_cache, row, adapter, head_keep=CANDIDATES)  # its logits go unread

    def _decode(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None) -> np.ndarray:
        out = self._logits.take((kv_cache.batch_size, self.config.vocab_size), np.float32)
        for row in range(kv_cache.batch_size):
            out[row] = self._run(tokens[row:row + 1], kv_cache.num_tokens, kv_cache, row, adapter)[0][0, 0]
        return out

    def _sample(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None,
                sampler: SamplerParams) -> np.ndarray:
        if self.sampler is None:  # a bundle converted with --no-sampler: same algorithm on the host
            return host_sample(self._decode(tokens, kv_cache, adapter), sampler, kv_cache.num_tokens)
        out = np.empty(kv_cache.batch_size, np.int32)  # every row is written below
        for row in range(kv_cache.batch_size):
            logits, logits_value = self._run(tokens[row:row + 1], kv_cache.num_tokens, kv_cache, row, adapter,
                                             head_keep=CANDIDATES)  # the sampler draws from these
            token = host_token(logits[0, 0], sampler, self.manifest.sampler_refuses_non_finite)
            out[row] = (token if token is not None else
                        self._sample_on_graph(logits_value, sampler, sampler.seed_for(kv_cache.num_tokens, row)))
        return out

    def _sample_on_graph(self, logits_value, sampler: SamplerParams, seed: int) -> int:
        return self._sampler_io.run(logits_value, sampler.graph_inputs(seed))

    # ---- cancellation inside a run ----------------------------------------------------------------
    def _interrupt_backend(self, calls: tuple) -> None:
        # Each cache runs with RunOptions of its own: terminating them stops that cache's run only.
        for call in calls:
            if call.kv_cache is not None:
                options = call.kv_cache.bindings.get((id(self), "run options"))  # none before its first run
                if options is not None:
                    options.terminate()


class _RunOptions:
    """The RunOptions of one cache's runs, so that a cancel's terminate flag reaches only them.
    After a chunk, ONNX Runtime's arena gives back what the chunk's activations took: a 1,024-token
    int4 prefill then 128 steps peaked at 287 MB instead of 321, at the same prefill speed
    (seventeenth round). Steps keep their arena."""

    def __init__(self, ort):
        self._ort = ort
        self.renew()

    def renew(self) -> None:
        """Fresh options for the next run: terminated ones stay so."""
        chunk = self._ort.RunOptions()
        chunk.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self.step, self.chunk = self._ort.RunOptions(), chunk

    def terminate(self) -> None:
        self.step.terminate = True
        self.chunk.terminate = True


class _SamplerBinding:
    """The sampler graph's IO binding, made once per executor. Its parameters are numpy arrays bound
    once and rewritten in place, and the logits are rebound only when another row's buffer comes: a
    new binding, four parameter arrays and an output per token took 34 us (LiteRT's _SamplerIO too)."""

    def __init__(self, ort, session):
        self.session = session
        self.io = session.io_binding()
        self.params = tuple(np.zeros(1, dtype) for _, dtype in SAMPLER_INPUTS)
        self.next_token = np.zeros(1, np.int32)
        # bound OrtValues must outlive the binding; they share the arrays' memory on the CPU
        self.keep = [ort.OrtValue.ortvalue_from_numpy(a) for a in (*self.params, self.next_token)]
        for (name, _), value in zip(SAMPLER_INPUTS, self.keep):
            self.io.bind_ortvalue_input(name, value)
        self.io.bind_ortvalue_output("next_token", self.keep[-1])
        self.logits = None  # the bound logits OrtValue, held so that its buffer outlives the binding
        self.lock = threading.Lock()  # calls on other caches may sample at the same time

    def run(self, logits_value, values: tuple[float, int, float, int]) -> int:
        """The token drawn from `logits_value` (an OrtValue [1, 1, V] float32) with the graph's
        parameter `values` (SamplerParams.graph_inputs)."""
        with self.lock:
            if logits_value is not self.logits:
                self.io.bind_ortvalue_input("logits", logits_value)
                self.logits = logits_value
            for param, value in zip(self.params, values):
                param[0] = value
            self.session.run_with_iobinding(self.io)
            return int(self.next_token[0])


class _RowBinding:
    """Everything bound for one cache row. Inputs are numpy arrays bound once and rewritten in
    place each call, so a decode step binds nothing; only a new chunk length or adapter rebinds."""

    def __init__(self, executor: OnnxExecutor, session, kv_cache: KVCache, row: int, options: _RunOptions):
        ort = executor._ort
        self.executor, self.options = executor, options
        self.io = session.io_binding()
        self.keep: dict[str, object] = {}  # bound OrtValues must outlive the binding
        for layer in range(executor.config.num_layers):
            for kind, buf in (("key", kv_cache.raw_keys(layer)), ("value", kv_cache.raw_values(layer))):
                value = ort.OrtValue.ortvalue_from_numpy(buf[row:row + 1])
                self.io.bind_ortvalue_input(f"past_{kind}_{layer}", value)
                self.io.bind_ortvalue_output(f"present_{kind}_{layer}", value)
                self.keep[f"past_{kind}_{layer}"] = value
        self.logits = aligned_zeros((1, 1, executor.config.vocab_size))
        self.logits_value = ort.OrtValue.ortvalue_from_numpy(self.logits)
        self.io.bind_ortvalue_output("logits", self.logits_value)
        self.seqlens = np.zeros(1, np.int32)
        self.total = np.zeros((), np.int32)
        self._bind("seqlens_k", self.seqlens)
        self._bind("total_sequence_length", self.total)
        # a screened head's: 0 computes every logit, k the rows that can rank among the k largest
        self.head_keep = np.zeros(1, np.int32)
        if HEAD_KEEP_INPUT in {i.name for i in session.get_inputs()}:
            self._bind(HEAD_KEEP_INPUT, self.head_keep)
        self.steps = -1
        self.lora_id: object = "unbound"

    def _bind(self, name: str, array: np.ndarray) -> None:
        value = self.executor._ort.OrtValue.ortvalue_from_numpy(array)
        self.io.bind_ortvalue_input(name, value)
        self.keep[name] = value

    def prepare(self, tokens: np.ndarray, start: int, lora_id: int | None, lora: dict[str, np.ndarray],
                head_keep: int = 0) -> None:
        steps = len(tokens)
        if steps != self.steps:
            self.tokens, self.positions = np.zeros((1, steps), np.int32), np.zeros(steps, np.int32)
            self._bind("tokens", self.tokens)
            self._bind("input_pos", self.positions)
            self.steps = steps
        self.tokens[0] = tokens
        self.positions[:] = np.arange(start, start + steps, dtype=np.int32)
        self.seqlens[0] = start + steps - 1
        self.total[...] = start + steps
        self.head_keep[0] = head_keep
        if lora_id != self.lora_id:
            for name, array in lora.items():
                self._bind(name, array)
            self.lora_id = lora_id
