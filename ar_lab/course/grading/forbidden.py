"""What each graded test forbids: the package's references for the exercise, made to raise while the
learner's code runs (``checks.no_delegation(..., forbid="chNN-name")``).

A test cell names its exercise's entry instead of listing the references, so it reads as the checks
it makes. An entry lists ar_lab's public functions, methods or classes by dotted name, PyTorch's, or
PyTorch operators as ``aten::name`` (``guard.forbidden`` resolves them). Never a private ar_lab
name: the private helpers a reference reaches, and no allowed function of its module does, are
forbidden with it (``guard.private_helpers``), so renaming an internal function changes no verdict.
"""

from ar_lab.base.errors import BadValue

# PyTorch's and ar_lab's ready-made attention, fused or not: what an exercise that writes attention
# forbids.
ATTENTION = (
    "torch.nn.functional.scaled_dot_product_attention",
    "ar_lab.model.gpt.CausalSelfAttention",
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "torch.nn.MultiheadAttention",
    "torch.nn.functional.multi_head_attention_forward",
    "aten::_native_multi_head_attention",
)

# ar_lab.model.tiled's ways of computing attention and its softmax: what chapter 10's exercises
# write.
TILED = (
    "ar_lab.model.tiled.online_softmax",
    "ar_lab.model.tiled.softmax_stats",
    "ar_lab.model.tiled.materialised_attention",
    "ar_lab.model.tiled.tile_plan",
    "ar_lab.model.tiled.tiled_attention",
    "ar_lab.model.tiled.decode_partials",
    "ar_lab.model.tiled.merge_partials",
    "ar_lab.model.tiled.split_decode",
)

# A whole row's softmax in one call: what a softmax computed chunk by chunk must not call (by name:
# the aten operators are left out, as the answer process's own PyTorch code runs them).
SOFTMAX = (
    "torch.softmax",
    "torch.nn.functional.softmax",
    "torch.logsumexp",
)

# PyTorch's RMSNorm: what chapter 11's norm (and the block that uses it) must not call.
RMS_NORM = (
    "torch.nn.functional.rms_norm",
    "torch.nn.RMSNorm",
    "aten::rms_norm",
)

FORBIDDEN: dict[str, tuple[str, ...]] = {
    # 00_start_here.ipynb
    "ch00-to-tokens": (
        "ar_lab.model.tokenizer.encode",
    ),
    "ch00-tokens-per-char": (
        "ar_lab.model.tokenizer.encode",
    ),
    # 01_the_autoregressive_loop.ipynb
    "ch01-generate-loop": (
        "ar_lab.engine.generate.generate",
        "ar_lab.engine.generate.stream",
        "ar_lab.engine.generate.token_steps",
        "ar_lab.engine.generate.sample_rows",
    ),
    "ch01-next-token-distribution": (
        "ar_lab.model.bigram.BigramModel",
    ),
    "ch01-sequence-log-prob": (
        "ar_lab.model.bigram.BigramModel",
    ),
    # 02_attention_and_the_causal_mask.ipynb
    "ch02-attention": ATTENTION,
    "ch02-embeddings": (
        "ar_lab.model.gpt.GPT",
        "ar_lab.engine.lean.LeanGPT",
    ),
    "ch02-multi-head": ATTENTION,
    # 03_build_a_gpt.ipynb
    "ch03-attention": (
        "torch.nn.functional.scaled_dot_product_attention",
        "torch.nn.functional.multi_head_attention_forward",
        "torch.nn.MultiheadAttention",
        "ar_lab.model.gpt.CausalSelfAttention",
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product_attention_math",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_native_multi_head_attention",
    ),
    "ch03-block": (
        "ar_lab.model.gpt.Block",
        "torch.nn.TransformerEncoderLayer",
        "torch.nn.TransformerDecoderLayer",
    ),
    "ch03-gpt": (
        "ar_lab.model.gpt.GPT",
        "ar_lab.engine.lean.LeanGPT",
        "ar_lab.engine.lean.for_model",
        "ar_lab.model.reference.to_hf_gpt2",
    ),
    "ch03-mlp": (
        "ar_lab.model.gpt.MLP",
    ),
    # 03b_train_a_gpt.ipynb
    "ch03-course-model": (
        "ar_lab.model.gpt.GPT",
        "ar_lab.model.gpt.Block",
        "ar_lab.model.gpt.CausalSelfAttention",
        "ar_lab.model.gpt.MLP",
        "ar_lab.engine.lean.LeanGPT",
        "ar_lab.engine.lean.for_model",
        "ar_lab.engine.generate.generate",
        "ar_lab.model.reference.to_hf_gpt2",
        "torch.nn.functional.scaled_dot_product_attention",
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product_attention_math",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ),
    "ch03-cross-entropy": (
        "torch.nn.functional.cross_entropy",
        "torch.nn.functional.nll_loss",
        "torch._C._nn.cross_entropy_loss",
        "torch._C._nn.nll_loss",
        "torch._C._nn.nll_loss_nd",
        "aten::cross_entropy_loss",
        "aten::nll_loss",
        "aten::nll_loss_nd",
        "aten::nll_loss_forward",
    ),
    "ch03-param-count": (
        "ar_lab.model.gpt.GPT",
        "ar_lab.model.gpt.GPT.num_parameters",
        "ar_lab.perf.roofline.parameter_count",
        "ar_lab.perf.roofline.ModelShape.parameters",
    ),
    "ch03-train-step": (
        "ar_lab.model.train.train",
        "ar_lab.model.train.make_optimizer",
        "ar_lab.model.train.train_step",
    ),
    # 04_kv_cache.ipynb
    "ch04-cache-write": (
        "ar_lab.model.cache.KVCache",
        "ar_lab.model.cache.KVCache.update",
    ),
    "ch04-cached-attention": (
        "torch.nn.functional.scaled_dot_product_attention",
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product_attention_math",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "torch.nn.functional.multi_head_attention_forward",
        "ar_lab.model.gpt.CausalSelfAttention",
        "ar_lab.model.gpt.GPT",
        "ar_lab.engine.lean.LeanGPT",
        "ar_lab.model.cache.KVCache.update",
    ),
    "ch04-positions": (
        "ar_lab.engine.generate.generate",
        "ar_lab.engine.generate.stream",
        "ar_lab.engine.generate.token_steps",
        "ar_lab.engine.generate.sample_rows",
    ),
    "ch04-scheme-bytes": (
        "ar_lab.perf.kv_sizing.cache_sizes",
        "ar_lab.model.cache.kv_cache_bytes",
        "ar_lab.perf.kv_sizing.mla_cache_bytes",
        "ar_lab.perf.roofline.kv_bytes_per_token",
    ),
    # 05_prefill_vs_decode.ipynb
    "ch05-decode-plan": (
        "ar_lab.perf.llm_costs.place_decode",
        "ar_lab.perf.llm_costs.decode_cost",
        "ar_lab.perf.llm_costs.forward_cost",
        "ar_lab.perf.llm_costs.max_batch",
        "ar_lab.perf.llm_costs.kv_memory",
        "ar_lab.perf.llm_costs.predicted_time",
        "ar_lab.perf.llm_costs.memory_needed",
        "ar_lab.perf.roofline.shape_cost",
    ),
    "ch05-predict-tpot": (
        "ar_lab.perf.roofline.approx_tpot",
        "ar_lab.perf.roofline.approx_decode_bytes",
    ),
    "ch05-probes": (  # the package's probes and timers: the exercise is to count and to time
        "ar_lab.perf.peaks.stream_probe",
        "ar_lab.perf.peaks.matmul_probe",
        "ar_lab.perf.peaks.measure_bandwidth",
        "ar_lab.perf.peaks.measure_matmul_peak",
        "ar_lab.perf.peaks.measure_peaks",
        "ar_lab.perf.peaks.streaming_kernels",
        "ar_lab.base.timing.time_call",
        "ar_lab.base.timing.interleaved",
        "torch.utils.benchmark.Timer",
    ),
    # 06_sampling.ipynb
    "ch06-sampler": (
        "ar_lab.engine.sampling.sample",
        "ar_lab.engine.pipeline.LogitsPipeline",
        "ar_lab.engine.pipeline.pick",
        "ar_lab.engine.sampling.probabilities",
        "ar_lab.engine.sampling.processed_logits",
        "ar_lab.engine.sampling.apply_temperature",
        "ar_lab.engine.sampling.filter_top_k",
        "ar_lab.engine.sampling.filter_top_p",
        "ar_lab.engine.sampling.filter_min_p",
        "ar_lab.course.views.sampler_view.sampler_view",
    ),
    "ch06-temperature": (
        "ar_lab.engine.sampling.probabilities",
        "ar_lab.engine.sampling.apply_temperature",
        "ar_lab.engine.sampling.processed_logits",
    ),
    "ch06-top-p": (
        "ar_lab.engine.sampling.filter_top_p",
        "ar_lab.engine.sampling.processed_logits",
        "ar_lab.engine.sampling.probabilities",
        "ar_lab.course.views.sampler_view.sampler_view",
    ),
    # 06b_beam_search_and_constraints.ipynb
    "ch06-grammar": (
        "ar_lab.engine.constrained.JsonObject",
        "ar_lab.engine.constrained.JsonObject.allowed_ids",
        "ar_lab.engine.constrained.Grammar.allowed",
        "ar_lab.engine.constrained.Grammar.advance",
        "ar_lab.engine.constrained.Grammar.state_after",
        "ar_lab.engine.constrained.Grammar.allowed_after",
        "ar_lab.engine.constrained.Grammar.accepts",
        "ar_lab.engine.constrained.json_problem",
    ),
    "ch06-ngrams": (
        "ar_lab.engine.sampling.repeated_ngram_fraction",
    ),
    # 07_speculative_decoding.ipynb
    "ch07-accept": (
        "ar_lab.engine.accept.accepted_count",
        "ar_lab.engine.accept.residual_distribution",
        "ar_lab.engine.accept.accept_step",
    ),
    "ch07-loop": (
        "ar_lab.engine.speculative.speculative_iteration",
        "ar_lab.engine.speculative.speculative_generate",
        "ar_lab.engine.speculative.Speculation.iteration",
        "ar_lab.course.checkers.mistakes.slipped_iteration",
    ),
    # 07b_drafts_without_a_draft_model.ipynb
    "ch07-lookup": (
        "ar_lab.engine.lookup.prompt_lookup",
        "ar_lab.engine.lookup.PromptLookup.__call__",
    ),
    # 08_in_production.ipynb
    "ch08-admit": (
        "ar_lab.engine.scheduling.static_admit",
        "ar_lab.engine.scheduling.continuous_admit",
        "ar_lab.engine.scheduling.policy_function",
    ),
    "ch08-row-mask": (
        "ar_lab.model.cache.BatchKVCache",
        "ar_lab.model.cache.BatchKVCache.begin",
        "ar_lab.model.cache.row_mask",
    ),
    "ch08-server-step": (
        "ar_lab.engine.serving.serve_step",
        "ar_lab.engine.serving.serve",
        "ar_lab.engine.serving.generate_batch",
        "ar_lab.engine.generate.generate",
        "ar_lab.engine.generate.token_steps",
        "ar_lab.engine.generate.sample_rows",
    ),
    # 08b_kv_memory_and_prompt_caching.ipynb
    "ch08-blocks": (
        "ar_lab.engine.paged.BlockAllocator",
        "ar_lab.engine.paged.blocks_for",
    ),
    # 08c_chunked_prefill_and_experts.ipynb
    "ch08-chunked-step": (
        "ar_lab.engine.serving.chunked_step",
        "ar_lab.engine.serving.serve_step",
        "ar_lab.engine.serving.serve",
        "ar_lab.engine.serving.generate_batch",
    ),
    "ch08-route": (
        "ar_lab.model.moe.route",
        "ar_lab.model.moe.MoE",
        "ar_lab.course.checkers.moe_checks.route_mistakes",
    ),
    "ch08-dispatch": (
        "ar_lab.model.moe.dispatch",
        "ar_lab.model.moe.MoE",
    ),
    # 09_quantization.ipynb
    "ch09-int4": (
        "ar_lab.engine.quant.quantize_int4",
        "ar_lab.engine.quant.quantize_int8",
        "ar_lab.engine.quant.absmax_quantize",
        "ar_lab.course.views.quant_view.quantize_groups",
    ),
    "ch09-int8": (
        "ar_lab.engine.quant.quantize_int8",
        "ar_lab.engine.quant.quantize_int4",
        "ar_lab.engine.quant.absmax_quantize",
        "ar_lab.engine.quant.dequantize",
        "ar_lab.engine.quant.QuantizedTensor.dequantize",
        "ar_lab.course.views.quant_view.quantize_groups",
        "ar_lab.course.views.quant_view.dequantize_groups",
    ),
    # 09b_gptq_awq_and_small_floats.ipynb
    "ch09-gptq": (
        "ar_lab.engine.calibrated.gptq_quantize",
        "ar_lab.engine.calibrated.calibrated_model",
        "ar_lab.course.checkers.calibration_checks.gptq_mistakes",
    ),
    "ch09-awq": (
        "ar_lab.engine.calibrated.awq_search",
        "ar_lab.engine.calibrated.awq_scales",
        "ar_lab.engine.calibrated.awq_candidate",
        "ar_lab.engine.calibrated.awq_dequantized",
        "ar_lab.engine.calibrated.calibrated_model",
        "ar_lab.course.checkers.calibration_checks.awq_mistakes",
    ),
    # 10_attention_as_engines_compute_it.ipynb
    "ch10-online-softmax": TILED + SOFTMAX,
    "ch10-split-decode": ATTENTION + TILED,
    "ch10-tiled-attention": ATTENTION + TILED + SOFTMAX,
    # 11_a_modern_block.ipynb
    "ch11-norm-mlp": RMS_NORM + (
        "ar_lab.model.block.mlp",
        "ar_lab.model.gpt.MLP",
        "ar_lab.course.checkers.modern_checks.rms_norm_mistakes",
        "ar_lab.course.checkers.modern_checks.swiglu_mistakes",
        "ar_lab.course.checkers.modern_checks.reference_block",
    ),
    "ch11-rope": (
        "ar_lab.model.block.Rope",
        "ar_lab.model.block.Rope.__call__",
        "ar_lab.course.checkers.modern_checks.rope_mistakes",
        "ar_lab.course.checkers.modern_checks.reference_block",
    ),
    "ch11-block": RMS_NORM + (
        "ar_lab.model.block.block",
        "ar_lab.model.block.attend",
        "ar_lab.model.block.residual",
        "ar_lab.model.block.mlp",
        "ar_lab.model.block.Rope",
        "ar_lab.model.block.Rope.__call__",
        "ar_lab.model.gpt.Block",
        "ar_lab.model.gpt.CausalSelfAttention",
        "ar_lab.model.gpt.MLP",
        "ar_lab.model.gpt.GPT",
        "ar_lab.model.attention.attention",
        "ar_lab.course.checkers.modern_checks.reference_block",
    ),
    "ch11-rolling": (
        "ar_lab.model.rolling.RollingKVCache",
        "ar_lab.model.attention.visible",
        "ar_lab.course.checkers.modern_checks.RingCache",
    ),
    # A1_measuring_time.ipynb
    "a1-compile-once": (
        "ar_lab.engine.compiled.compile_once",
        "ar_lab.engine.compiled.compiled_step",
        "ar_lab.engine.compiled.CompiledStep",
        "ar_lab.engine.compiled.CompiledDecoder",
    ),
}


def references(exercise: str) -> tuple[str, ...]:
    """The references ``exercise``'s graded test forbids (its grade id without ``-tests``)."""
    if exercise not in FORBIDDEN:
        raise BadValue(
            f"no forbid list for the exercise {exercise!r}: add it to "
            f"ar_lab/course/grading/forbidden.py (known: {', '.join(sorted(FORBIDDEN))})",
            arg="exercise",
        )
    return FORBIDDEN[exercise]
