"""Answers that only call the package's reference (or PyTorch's ready-made kernel) for each
exercise.

Each would pass its graded test if nothing stopped it; ``tests/test_delegation.py`` proves that
``ar_lab.course.checkers.checks.no_delegation`` makes every one of them fail. Keyed by the solution
cell's grade_id.
"""

DELEGATING = {
    "ch00-to-tokens": """
def to_tokens(text):
    from ar_lab.model.tokenizer import encode
    return encode(text)
""",
    "ch00-tokens-per-char": """
def tokens_per_char(text):
    from ar_lab.model.tokenizer import encode
    return len(encode(text)) / len(text)
""",
    "ch01-next-token-distribution": """
def next_token_distribution(counts, token, smoothing=0.1):
    from ar_lab.model.bigram import BigramModel
    return BigramModel(counts, smoothing=smoothing).log_probs[token].exp()
""",
    "ch01-sequence-log-prob": """
def sequence_log_prob(log_probs, tokens):
    from ar_lab.model.bigram import BigramModel
    lp = BigramModel(log_probs.exp(), smoothing=0.0)(torch.tensor([tokens]))[0]
    return float(
        lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:], dtype=torch.long)].sum()
    )
""",
    "ch01-generate-loop": """
def my_generate(model, prompt, max_new_tokens, eos_id=EOS_ID):
    return ar_lab.generate(model, prompt, max_new_tokens, use_cache=False, eos_id=eos_id).tokens
""",
    "ch02-embeddings": """
def embed(idx, wte, wpe):
    from ar_lab.model.gpt import GPT, GPTConfig
    from ar_lab.course.checkers.model_checks import record_calls
    gpt = GPT(
        GPTConfig(
            vocab_size=wte.shape[0],
            block_size=wpe.shape[0],
            n_layer=1,
            n_head=1,
            n_embd=wte.shape[1],
        )
    )
    gpt.wte.weight.data, gpt.wpe.weight.data = wte, wpe
    return record_calls(gpt, lambda: gpt(idx))["blocks.0"][0]
""",
    "ch02-attention": """
def attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
""",
    "ch02-multi-head": """
def multi_head_attention(x, W_qkv, b_qkv, W_proj, b_proj, n_head):
    T, C = x.shape
    q, k, v = (
        rearrange(t, "t (h d) -> h t d", h=n_head) for t in (x @ W_qkv.T + b_qkv).split(C, dim=-1)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return rearrange(y, "h t d -> t (h d)") @ W_proj.T + b_proj
""",
    "ch03-attention": """
class MyAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
""",
    "ch03-mlp": """
class MyMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        from ar_lab.model.gpt import MLP
        mlp = MLP(GPTConfig(n_embd=self.fc.in_features, n_head=1))
        mlp.load_state_dict(self.state_dict())
        return mlp(x)
""",
    "ch03-block": """
class MyBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = MyAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MyMLP(cfg)

    def forward(self, x):
        from ar_lab.model.gpt import Block
        block = Block(self.cfg)
        block.load_state_dict(self.state_dict())
        return block(x, None, 0, 0)
""",
    "ch03-gpt": """
class MyGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.inner = GPT(cfg)
        self.wte, self.wpe, self.blocks = self.inner.wte, self.inner.wpe, self.inner.blocks
        self.ln_f, self.lm_head = self.inner.ln_f, self.inner.lm_head

    def forward(self, idx):
        return self.inner(idx)

    def state_dict(self, *args, **kwargs):
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.inner.load_state_dict(*args, **kwargs)
""",
    "ch03-param-count": """
def gpt_param_count(cfg):
    return GPT(cfg).num_parameters()
""",
    "ch03-cross-entropy": """
def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
""",
    "ch03-train-step": """
def make_optimizer(model, tc):
    return torch.optim.AdamW(model.parameters(), lr=tc.lr)


def train_step(model, optimizer, x, y, lr, grad_clip):
    from ar_lab.model.train import TrainConfig, train
    tokens = torch.cat([x[0], y[0, -1:]])
    tc = TrainConfig(steps=1, batch_size=x.shape[0], block_size=x.shape[1], lr=lr, warmup_steps=1,
                     grad_clip=grad_clip, eval_batches=1)
    return train(model, tokens, tokens, tc, progress=False).train_loss[0]
""",
    "ch03-course-model": """
def greedy(model, prompt, n):
    return ar_lab.generate(course, prompt, n, eos_id=None).tokens


your_course_gpt = MyGPT(course.config)
your_course_gpt.load_state_dict(course.state_dict())
""",
    "ch04-positions": """
def positions_processed(P, N, use_cache):
    from ar_lab.engine.generate import generate
    from ar_lab.model.gpt import GPT, GPTConfig
    m = GPT(GPTConfig(block_size=P + N, n_layer=1, n_head=1, n_embd=8))
    return generate(m, [0] * P, N, use_cache=use_cache, eos_id=None).stats.positions_processed
""",
    "ch04-cache-write": """
def cache_write(k_buf, v_buf, start, k, v):
    from ar_lab.model.cache import KVCache
    return KVCache.from_buffers([k_buf], [v_buf]).update(0, start, k, v)
""",
    "ch04-cached-attention": """
def cached_attention(attn, x, cache, layer, start):
    B, T, C = x.shape
    q, k, v = (
        rearrange(t, "b t (h d) -> b h t d", h=attn.n_head) for t in attn.qkv(x).split(C, dim=-1)
    )
    if cache is not None:
        k, v = cache_write(cache.k[layer], cache.v[layer], start, k, v)
    sees = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=sees)
    return attn.proj(rearrange(y, "b h t d -> b t (h d)"))
""",
    "ch04-scheme-bytes": """
def kv_bytes_per_token(
    scheme, n_layer, n_head, n_kv_heads, head_dim, latent_dim, rope_dim, bytes_per_value
):
    from ar_lab.perf.kv_sizing import AttentionShape, cache_sizes
    shape = AttentionShape(n_layer, n_head, n_kv_heads, head_dim, latent_dim, rope_dim)
    return cache_sizes(shape, 1, 1, bytes_per_value)[scheme]
""",
    "ch05-probes": """
def fastest(fn, repeats):
    from ar_lab.base.timing import time_call
    return min(time_call(fn, repeats=repeats, warmup=1, device=device))


def stream_probe(n, repeats=5):
    return peaks.stream_probe(n, repeats, device=device, dtype=dtype)


def matmul_probe(m, k, n, repeats=5):
    return peaks.matmul_probe(m, k, n, repeats, device=device, dtype=dtype)
""",
    "ch05-predict-tpot": """
def predict_tpot(n_params, bytes_per_param, bandwidth, kv_cache_bytes=0.0):
    return rl.approx_tpot(n_params, bandwidth, bytes_per_param) + kv_cache_bytes / bandwidth
""",
    "ch05-decode-plan": """
def decode_plan(shape, gpu, context):
    place = lc.place_decode(shape, gpu, context)
    return {
        "tpot": lc.predicted_time(lc.decode_cost(shape, context), gpu),
        "max_batch": place.max_batch,
        "matmul_batch": place.matmul_compute_bound_batch,
        "attention_intensity": place.attention_intensity,
    }
""",
    "ch06-temperature": """
from ar_lab.engine.sampling import GREEDY_EPS


def my_temperature_probabilities(logits, temperature):
    return probabilities(logits, SamplingParams(temperature=temperature))
""",
    "ch06-top-p": """
def my_top_p_keep(probs, p):
    return filter_top_p(probs.log(), p) > float("-inf")
""",
    "ch06-sampler": """
def my_sampler_probabilities(logits, params):
    return probabilities(logits, params)


def my_sample(logits, params, generator=None):
    return int(sample(logits, params, generator))
""",
    "ch06-ngrams": """
def my_repeated_ngram_fraction(tokens, n):
    return repeated_ngram_fraction(tokens, n)
""",
    "ch06-grammar": """
def my_allowed_next(prefix):
    return set(grammar.allowed_after(list(prefix)).nonzero().flatten().tolist())
""",
    "ch07-accept": """
from ar_lab.engine.accept import accepted_count


def my_accept_step(p, q, drafts, u):
    rows = torch.arange(len(drafts))
    n = accepted_count(p[rows, drafts].double(), q[rows, drafts].double(), u.double())
    return n, (residual_distribution(p[n], q[n]) if n < len(drafts) else p[n])
""",
    "ch07-loop": """
from ar_lab.engine.speculative import speculative_iteration


def my_iteration(target, draft, seq, gamma, accept, probs, generator):
    return speculative_iteration(target, draft, seq, gamma, accept, probs, generator)
""",
    "ch07-lookup": """
from ar_lab.engine.lookup import prompt_lookup


def my_prompt_lookup(tokens, k, max_ngram=3):
    return prompt_lookup(tokens, k, max_ngram)
""",
    "ch08-admit": """
from ar_lab.engine.scheduling import continuous_admit, static_admit


def my_static_admit(waiting, running, max_batch):
    return static_admit(waiting, running, max_batch)


def my_continuous_admit(waiting, running, max_batch):
    return continuous_admit(waiting, running, max_batch)
""",
    "ch08-row-mask": """
def my_row_mask(lengths, T):
    c = BatchKVCache(
        n_layer=1, max_batch=len(lengths), n_kv_heads=1, max_len=max(lengths) + T, head_dim=1
    )
    for n in lengths:
        c.add(n)
    return c.begin(T)[1]
""",
    "ch08-blocks": """
from ar_lab.engine.paged import BlockAllocator


class MyBlockAllocator:
    def __init__(self, num_blocks, block_size):
        self.inner = BlockAllocator(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def num_free(self):
        return self.inner.num_free

    def table(self, request):
        return self.inner.table(request)

    def refcount(self, block):
        return self.inner.refcount(block)

    def allocate(self, request, n_tokens=0):
        self.inner.allocate(request, n_tokens)

    def grow(self, request, n_tokens):
        self.inner.grow(request, n_tokens)

    def fork(self, parent, child, n_tokens):
        self.inner.fork(parent, child, n_tokens)

    def free(self, request):
        self.inner.free(request)
""",
    "ch08-server-step": """
from ar_lab.engine.serving import serve_step


def my_server_step(server):
    serve_step(server)
""",
    "ch08-chunked-step": """
from ar_lab.engine.serving import chunked_step


def my_chunked_step(server, chunk):
    chunked_step(server, chunk)
""",
    "ch08-route": """
def my_route(logits, k):
    from ar_lab.model.moe import route
    return route(logits, k)
""",
    "ch08-dispatch": """
def my_dispatch(h, experts, weights, expert_fns):
    from ar_lab.model.moe import dispatch
    return dispatch(h, experts, weights, expert_fns)
""",
    "ch09-int8": """
def my_quantize_int8(w):
    qt = quantize_int8(w)
    return qt.q, qt.scale


def my_dequantize_int8(q, scale):
    return dequantize(QuantizedTensor(q, scale, 8, None))
""",
    "ch09-int4": """
def my_quantize_int4(w, group_size):
    qt = quantize_int4(w, group_size)
    return qt.q, qt.scale
""",
    "ch09-gptq": """
from ar_lab.engine.calibrated import gptq_quantize


def my_gptq(w, stats, group_size, damp):
    qt = gptq_quantize(w, stats.hessian, group_size, damp=damp)
    return qt.q, qt.scale
""",
    "ch09-awq": """
from ar_lab.engine.calibrated import awq_search


def my_awq_scales(w, stats, group_size, grid):
    return awq_search(w, stats, group_size, grid=grid).scale
""",
    "ch10-online-softmax": """
def my_online_softmax(x, chunk):
    from ar_lab.model.tiled import online_softmax
    return online_softmax(x, chunk=chunk)
""",
    "ch10-tiled-attention": """
def my_tiled_attention(q, k, v, offset, tile_q, tile_k):
    from ar_lab.model.tiled import tiled_attention
    return tiled_attention(q, k, v, offset=offset, tile_q=tile_q, tile_k=tile_k)
""",
    "ch10-split-decode": """
def my_split_decode(q, k, v, splits):
    from ar_lab.model.tiled import split_decode
    return split_decode(q, k, v, splits=splits)
""",
    "ch11-norm-mlp": """
def my_rms_norm(x, weight, eps=1e-5):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def my_swiglu(x, fc_weight, proj_weight):
    from ar_lab.model.block import mlp
    return mlp(x, lambda t: t @ fc_weight.T, lambda t: t @ proj_weight.T, gated=True)
""",
    "ch11-rope": """
def my_rope(x, pos, theta=10000.0):
    from ar_lab.model.block import Rope
    return Rope(x.shape[-1], theta, pos + x.shape[2])(x, pos)
""",
    "ch11-block": """
def my_block(x, w, cache, layer, pos, cfg):
    from ar_lab.course.checkers.modern_checks import reference_block
    return reference_block(x, w, cache, layer, pos, cfg)
""",
    "ch11-rolling": """
from ar_lab.course.checkers.modern_checks import RingCache


class MyRollingCache(RingCache):
    pass
""",
    "a1-compile-once": """
def compile_once(step):
    from ar_lab.engine.compiled import compile_once as theirs
    return theirs(step)
""",
}

# Exercises with no reference in the package to delegate to (their graded tests need no guard).
NO_REFERENCE = {"ch02-causal-mask"}

# The same delegation by other routes (issue 33), some of which the kernel's name-swapping gate does
# not see (a default argument, a C function, a copy of a helper's source): under the grading step
# each must fail, naming the withheld reference. Keyed by grade_id; each chapter's routes are judged
# together.
ROUTES = {
    "ch00-to-tokens": """
import concurrent.futures


def to_tokens(text):  # on a worker thread
    from ar_lab.model.tokenizer import encode
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(encode, text).result()
""",
    "ch00-tokens-per-char": """
import ar_lab.model.tokenizer


def tokens_per_char(text, count=ar_lab.model.tokenizer.encode):  # captured in a default argument
    return len(count(text)) / len(text)
""",
    "ch02-attention": """
def attention(q, k, v, mask=None):  # PyTorch's operator, under its aten name
    return torch.ops.aten.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
""",
    "ch03-cross-entropy": """
def cross_entropy(logits, targets):  # the C function F.cross_entropy calls
    return torch._C._nn.cross_entropy_loss(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
""",
    "ch03-param-count": """
from ar_lab.perf.roofline import from_gpt_config


def gpt_param_count(cfg):  # the count parameter_count reads, reached around it
    return from_gpt_config(cfg).parameters
""",
    "ch06-top-p": """
import inspect

import ar_lab.engine.sampling as s

_copy = {**vars(s)}
exec(inspect.getsource(s._top_p), _copy)  # the package's private helper, copied and run again


def my_top_p_keep(probs, p):
    return _copy["_top_p"](probs.log(), p) > float("-inf")
""",
}
