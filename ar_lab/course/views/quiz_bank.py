"""Self-check questions, one short quiz per chapter (shown by ``ar_lab.course.views.quiz.show``).

Each question: the prompt, the choices, the index of the right one *in the list as
written here*, and an explanation shown after an attempt (right or wrong).
True/false questions have the choices ["True", "False"] and are shown in that order;
``ar_lab.course.views.quiz.questions`` shows the choices of every other question in a fixed order
derived from its prompt, so where an answer is written here says nothing about where
it appears. Write wrong choices that a learner could believe, about as long as the
right one: ``tests/test_quiz.py`` fails if the key becomes guessable by position or
by length. (If a new question tips the positions over the limit, list its choices
here in another order: the shown order is a fixed permutation of the written one.)
"""

TF = ["True", "False"]

QUIZZES: dict[str, list[dict]] = {
    "00": [
        {
            "q": "How many tokens does the course's tokenizer use for the text 'é'?",
            "choices": ["1", "2", "3"],
            "answer": 1,
            "why": "Tokens are UTF-8 bytes, and 'é' is two bytes in UTF-8 (0xC3 0xA9).",
        },
        {
            "q": "A test cell fails with 'not implemented yet'. What should you do?",
            "choices": [
                "Replace the `raise NotImplementedError()` line in the exercise cell above",
                "Edit the test cell so that it calls ar_lab's own version of the function",
                "Restart the kernel and run all cells: the error comes from running out of order",
            ],
            "answer": 0,
            "why": "Test cells are locked; the exercise cell above holds the stub to replace. "
            "Later cells use "
            "ar_lab's own version, so the rest of the chapter still runs.",
        },
        {
            "q": "Every notebook in the course runs on a CPU without a GPU.",
            "choices": TF,
            "answer": 0,
            "why": "Everything is sized for a laptop CPU or a free Binder; a GPU, when "
            "present, is used automatically.",
        },
    ],
    "01": [
        {
            "q": "Why is decoding sequential?",
            "choices": [
                "The input of step t+1 contains the token picked at step t, which does "
                "not exist earlier",
                "Processors cannot run the positions of one sequence in parallel, so "
                "each needs a pass",
                "The causal mask forbids computing any position before every earlier "
                "one has been computed",
            ],
            "answer": 0,
            "why": "Each new token depends on the previous one, so steps cannot overlap. "
            "Training is parallel "
            "because the whole text is known in advance; the causal mask is what makes "
            "that parallel pass honest.",
        },
        {
            "q": "The chain rule p(x1..xn) = Π p(xt | x<t) is an approximation that ignores "
            "long-range effects.",
            "choices": TF,
            "answer": 1,
            "why": "It is an exact identity of probability. Approximations come only from the "
            "model of each factor "
            "(a bigram model, for example, looks at one previous token).",
        },
        {
            "q": "A loop generates 50 tokens and then the model picks EOS. What happens?",
            "choices": [
                "It keeps going to max_new_tokens",
                "It stops; EOS is not part of the text",
                "It stops and keeps EOS in the text",
            ],
            "answer": 1,
            "why": "EOS (id 256 here) ends the text and is not returned with it. "
            "ar_lab.generate reports "
            "stop_reason='eos'.",
        },
        {
            "q": "Why do we add log-probabilities instead of multiplying probabilities?",
            "choices": [
                "Adding is faster than multiplying, and decoding is limited by arithmetic",
                "A product of hundreds of probabilities below 1 underflows to 0.0",
                "The model outputs log-probabilities, so exponentiating them wastes time",
            ],
            "answer": 1,
            "why": "A product of hundreds of probabilities falls below the smallest float; a "
            "sum of logs does not. "
            "(The model outputs logits, and speed has nothing to do with it.)",
        },
    ],
    "02": [
        {
            "q": "What does the causal mask do during training?",
            "choices": [
                "It hides a random share of the tokens for the model to fill in",
                "It stops each position from attending to later positions",
                "It zeroes the attention paid to padding in a batch of short texts",
            ],
            "answer": 1,
            "why": "Scores of future positions become -inf, so their weights are 0: training "
            "sees only the past, "
            "exactly as generation will. Hiding random tokens is BERT's objective; a "
            "padding mask is another mask.",
        },
        {
            "q": "Why divide attention scores by √d?",
            "choices": [
                "To keep the softmax from going nearly one-hot as the head size grows",
                "To scale each value vector to unit length before the weighted sum",
                "To make the scores of future positions small enough for the mask to work",
            ],
            "answer": 0,
            "why": "Dot products of d-dimensional vectors grow like √d; dividing keeps the "
            "scores' scale independent "
            "of d and the softmax trainable. The mask sets future scores to -inf, "
            "whatever their scale.",
        },
        {
            "q": "In multi-query attention (MQA) all query heads share one key/value head.",
            "choices": TF,
            "answer": 0,
            "why": "MQA: one K/V head; GQA: groups of query heads share a K/V head; MHA: one "
            "K/V head per query head.",
        },
    ],
    "03": [
        {
            "q": "Weight tying means:",
            "choices": [
                "The output layer reuses the token-embedding matrix",
                "Every block shares one set of attention and MLP weights",
                "The key and value projections share one weight matrix",
            ],
            "answer": 0,
            "why": "GPT-2 ties the output projection to the token embedding, saving V × C "
            "parameters.",
        },
        {
            "q": "In the course model's pre-norm blocks, where is each LayerNorm applied?",
            "choices": [
                "On the embeddings only, once, before the first block of the stack",
                "At the input of each branch: before attention, before the MLP",
                "On the residual stream after each addition",
            ],
            "answer": 1,
            "why": "Pre-norm (GPT-2) normalises what goes into each branch and adds the "
            "branch's output to the "
            "unnormalised stream; only ln_f normalises the stream itself, after the "
            "last block. Normalising "
            "after each addition is the original Transformer's post-norm.",
        },
        {
            "q": "Swap the course model's tanh-approximated GELU for the exact GELU, same "
            "weights. Its logits:",
            "choices": [
                "Stay the same: the two agree exactly",
                "Move by far more than float32 rounding would",
                "Change in the first block only: later blocks undo it",
            ],
            "answer": 1,
            "why": "The two GELUs differ by less than 10⁻³ per value, but the gaps add up: "
            "part 1 measures them "
            "growing block after block, to logits far further apart than float32 "
            "rounding puts them.",
        },
        {
            "q": "Our GPT gives the same logits as Hugging Face's GPT2LMHeadModel with the "
            "same weights.",
            "choices": TF,
            "answer": 0,
            "why": "With one key/value head per query head it is GPT-2's architecture; part 1 "
            "compares the "
            "logits and 40 greedy tokens.",
        },
    ],
    "03b": [
        {
            "q": "The loss of a freshly initialised course model is close to:",
            "choices": ["1/257 ≈ 0.0039 nats", "ln 257 ≈ 5.55 nats", "log₂ 257 ≈ 8.01 nats"],
            "answer": 1,
            "why": "An untrained model spreads probability almost evenly over 257 tokens: "
            "−ln(1/257) = ln 257. "
            "(log₂ 257 is the same loss in bits.)",
        },
        {
            "q": "sum(p.numel() for p in model.parameters()) on the course model, whose "
            "lm_head is tied to wte:",
            "choices": [
                "Counts the shared (V, C) matrix once",
                "Counts it twice, under each name",
                "Leaves it out, since no single layer owns it",
            ],
            "answer": 0,
            "why": "parameters() lists each parameter object once, and a tied matrix is one "
            "object under two "
            "names; state_dict() lists both names (so a checkpoint loads into either layer).",
        },
        {
            "q": "Which parameters does the course trainer's AdamW decay?",
            "choices": [
                "Every parameter, biases and LayerNorms included",
                "The matrices: embeddings and linear weights",
                "Only the biases and the LayerNorm parameters",
            ],
            "answer": 1,
            "why": "Two parameter groups: the 2-D parameters with weight decay, the 1-D ones "
            "(biases, LayerNorm "
            "gains and shifts) without, as nanoGPT's trainer sets it up too.",
        },
        {
            "q": "A training loop never calls optimizer.zero_grad(). What happens?",
            "choices": [
                "Nothing changes, since every call of backward() overwrites .grad",
                "Each update uses the gradients of all steps so far, summed",
                "backward() raises an error at the second step",
            ],
            "answer": 1,
            "why": "backward() adds into .grad; without a reset, step n updates with the sum "
            "of n steps' "
            "gradients. The graded test of the training step names this mistake.",
        },
    ],
    "04": [
        {
            "q": "Generating 1,000 tokens from a 1-token prompt without a KV cache "
            "processes how many positions?",
            "choices": ["1,000", "500,500", "1,000,000"],
            "answer": 1,
            "why": "Step n feeds n positions: 1 + 2 + … + 1,000 = 500,500. With a cache: 1 + "
            "999 × 1 = 1,000.",
        },
        {
            "q": "Turning off the KV cache 'for safety' only costs a little time.",
            "choices": TF,
            "answer": 1,
            "why": "The work grows quadratically with length instead of linearly; chapter 04 "
            "measures the gap growing "
            "with the output length. The cache changes no output.",
        },
        {
            "q": "Which change shrinks the KV cache without shrinking the number of query heads?",
            "choices": [
                "Tying the output layer to the token embedding",
                "Grouped-query attention: fewer KV heads per layer",
                "A longer context window at the same batch size",
            ],
            "answer": 1,
            "why": "Cache bytes = layers × KV heads × head dim × sequence × batch × 2 × bytes "
            "per value. Weight tying "
            "saves parameters, not cache; a longer context grows the cache.",
        },
        {
            "q": "ar_lab.engine.lean runs the same arithmetic as a cached GPT.forward() "
            "decode step and gives the same "
            "tokens in less time. What does it leave out?",
            "choices": [
                "The attention over cached positions, which a one-token step can skip",
                "Pushing one token through layers built for batches: module calls, bookkeeping",
                "The copy of the whole KV cache that GPT.forward() makes at every step",
            ],
            "answer": 1,
            "why": "Chapter 04 measures both above a weights-only floor: direct tensor calls "
            "keep every product, the "
            "attention over the cache included, and drop the per-layer machinery "
            "(nn.Module calls, shape "
            "bookkeeping, an attention kernel set up for batches). The preallocated "
            "cache copies nothing either way.",
        },
    ],
    "05": [
        {
            "q": "Decode at batch size 1 is usually limited by:",
            "choices": [
                "Arithmetic: a token costs 2 FLOPs for every weight",
                "Memory bandwidth: every weight is read for one token",
                "The sampler: a softmax over the vocabulary every step",
            ],
            "answer": 1,
            "why": "One token does ~2 FLOPs per weight but reads every weight once: "
            "arithmetic intensity ~1 FLOP/byte "
            "(fp16), far below the ridge point. Picking the token is a small share of a step.",
        },
        {
            "q": "The first token of a long prompt is slow, later tokens fast. Which fix "
            "targets this?",
            "choices": [
                "Caching the static prompt prefix, so only what follows it is prefilled",
                "Quantising the weights to int8 to halve their bytes",
                "Speculative decoding with a small draft model",
            ],
            "answer": 0,
            "why": "TTFT is prefill (compute-bound on the prompt): a prefix cache or a "
            "shorter prompt cuts it. "
            "Fewer bytes per weight and speculative decoding speed up the later "
            "tokens, the memory-bound decode.",
        },
        {
            "q": "Why do time to first token (TTFT) and tokens per second need different fixes?",
            "choices": [
                "Prefill reads the whole prompt from memory and is bandwidth-bound; "
                "decode is bound by FLOP/s",
                "Prefill is limited by FLOP/s; each decode step by the bytes it must "
                "read from memory",
                "TTFT is mostly tokenizing and queueing; only the later tokens depend on the model",
            ],
            "answer": 1,
            "why": "Prefill runs the whole prompt in one parallel pass, each weight read "
            "serving every prompt token: "
            "compute-bound, so TTFT falls with more FLOP/s, a cached prompt prefix or "
            "a shorter prompt. A decode "
            "step reads all the weights and the KV cache for one token per sequence: "
            "memory-bound, so tokens per "
            "second rise with fewer bytes per token (quantised weights, batching, "
            "speculative decoding, a smaller "
            "KV cache).",
        },
        {
            "q": "Batching more requests into one decode step moves it toward the compute roof.",
            "choices": TF,
            "answer": 0,
            "why": "The weights are read once for the whole batch, so FLOPs per byte grow "
            "with the batch size; but "
            "each sequence reads its own KV cache, so at long contexts the intensity "
            "levels off below a GPU's ridge.",
        },
        {
            "q": "'Generate 800 tokens' takes about the same time as processing an "
            "800-token prompt.",
            "choices": TF,
            "answer": 1,
            "why": "Latency = TTFT + (N − 1) × TPOT; 799 sequential decode steps each read "
            "all the weights, while a "
            "prompt is processed in one parallel pass.",
        },
    ],
    "06": [
        {
            "q": "Top-p with p = 0.9 keeps:",
            "choices": [
                "Every token whose own probability is at least 0.9, or the top token if none is",
                "The fewest most likely tokens whose mass reaches 0.9, the crossing token included",
                "The most likely tokens whose total mass stays below 0.9, without the "
                "crossing token",
            ],
            "answer": 1,
            "why": "Nucleus sampling (Holtzman et al., 2020) keeps the head of the sorted "
            "distribution up to and "
            "including the token that makes the cumulative mass reach p; without that "
            "token, p = 0.5 on a "
            "0.6-probability token would keep nothing.",
        },
        {
            "q": "Temperature 0 means:",
            "choices": [
                "Uniform sampling over the whole vocabulary",
                "Greedy: always the most likely token",
                "An error: the logits would be divided by zero",
            ],
            "answer": 1,
            "why": "As T → 0 the softmax puts all mass on the argmax; ar_lab treats T below a "
            "small epsilon as greedy "
            "instead of dividing by it. Uniform sampling is the other end, T → ∞.",
        },
        {
            "q": "Changing the sampler changes the model's forward pass.",
            "choices": TF,
            "answer": 1,
            "why": "The logits are identical; only the pick from them changes.",
        },
        {
            "q": "Min-p 0.1 at temperature 1.5, applied after the temperature (as ar_lab "
            "and transformers do) instead "
            "of on the untempered distribution: which tokens does it keep?",
            "choices": [
                "The same ones: min-p compares each token with the top one, a ratio "
                "temperature leaves alone",
                "More of them: at T > 1 the ratios to the top token grow, so more pass the 0.1 bar",
                "Fewer of them: the flatter distribution pushes every probability "
                "below 0.1 of the top",
            ],
            "answer": 1,
            "why": "Temperature raises every ratio p / p_max to the power 1/T; after it, a "
            "token passes when its "
            "untempered ratio is at least 0.1^1.5 ≈ 0.03, a lower bar than 0.1, so "
            "more tokens survive.",
        },
    ],
    "06b": [
        {
            "q": "With length_penalty = 0, beam search ranks finished texts by their summed "
            "log-probability. "
            "Which texts does that favour?",
            "choices": [
                "Long ones: every extra token adds to the sum, so more tokens score higher",
                "Short ones: every extra token adds a log-probability below zero to the sum",
                "Neither: a sum of log-probabilities does not depend on the length of a text",
            ],
            "answer": 1,
            "why": "A log-probability is at most 0, so each token can only lower the sum; a "
            "length penalty of 1 "
            "divides by the length and compares log-probability per token instead.",
        },
        {
            "q": "On open-ended text, the continuation that beam search finds (more likely "
            "under the model than "
            "greedy's) usually repeats itself:",
            "choices": [
                "Less than greedy's: searching wider steers it away from greedy's loops",
                "About as much as human text: the beams average the model's choices out",
                "About as much as greedy's or more: likely text under the model is often a loop",
            ],
            "answer": 2,
            "why": "Maximising likelihood is what produces the loops (Holtzman et al., 2020): "
            "once a phrase repeats, "
            "repeating it again is likely. The chapter measures beam search repeating "
            "about as much as greedy.",
        },
        {
            "q": "A grammar's mask sets refused tokens to −∞ before the sampler chain. At T "
            "= 1 with no truncation, "
            "an allowed token t is drawn with probability:",
            "choices": [
                "p(t), its probability under the model: the refused tokens' mass is simply lost",
                "p(t) / (sum of p over the allowed tokens)",
                "1 / (number of allowed tokens): the grammar decides, not the model",
            ],
            "answer": 1,
            "why": "The softmax after the mask renormalises over the allowed set. That is "
            "also why it can force the "
            "model onto a path it finds unlikely: when every allowed token has a small "
            "p, one of them still gets all "
            "the mass.",
        },
        {
            "q": "Why mask before top-p rather than after it?",
            "choices": [
                "After top-p, every token of the nucleus might be refused, leaving nothing to pick",
                "Masking after top-p would change the model's logits",
                "It makes no difference: both orders keep the same tokens",
            ],
            "answer": 0,
            "why": "Truncation keeps the model's most likely tokens; if the grammar refuses "
            "all of them, nothing "
            "survives. Masking first makes the nucleus out of allowed tokens only.",
        },
    ],
    "07": [
        {
            "q": "Speculative decoding improves the quality of answers.",
            "choices": TF,
            "answer": 1,
            "why": "It is exact: its outputs have precisely the target model's distribution "
            "(a statistical test shows "
            "it). It changes speed, never quality.",
        },
        {
            "q": "When a draft token x is rejected, the replacement is drawn from:",
            "choices": [
                "The target distribution p",
                "The residual norm(max(0, p − q))",
                "The draft distribution q",
            ],
            "answer": 1,
            "why": "Resampling from the residual corrects exactly for the mass the draft "
            "over-proposed "
            "(Leviathan et al., 2023; Chen et al., 2023).",
        },
        {
            "q": "With acceptance rate α and γ drafts, the expected tokens per target call is:",
            "choices": ["1 + α + α² + … + α^γ", "1 + γ·α", "1 + α + α² + … + α^(γ+1)"],
            "answer": 0,
            "why": "The accepted prefix stops at the first rejection, so at least k drafts "
            "pass with probability α^k "
            "(k ≤ γ), plus one token from the target (a correction or the bonus token): the sum is "
            "(1 − α^(γ+1)) / (1 − α).",
        },
        {
            "q": "All γ drafts of an iteration pass the acceptance test. What else does the "
            "iteration emit?",
            "choices": [
                "Nothing more: the target's one pass scored only the γ drafted positions",
                "A bonus token, drawn from the target's next distribution",
                "One more draft token, kept without a test because the previous γ all passed",
            ],
            "answer": 1,
            "why": "The verifying pass scores γ + 1 positions: the γ drafts and the one after "
            "them. When every draft "
            "passes, p at that last position is already computed, so a token is drawn "
            "from it: γ + 1 tokens for one "
            "target call. Skipping it wastes a token per iteration; drawing it from "
            "another row breaks exactness.",
        },
        {
            "q": "Draft A predicts the text better than draft B (a lower validation loss), "
            "but B's next-token "
            "distributions are closer to the target's. Both cost the same per step. "
            "Which drafts faster?",
            "choices": [
                "A: a draft that predicts the text better guesses more tokens right",
                "B: α measures agreement with the target, not with the text",
                "Neither: the speedup depends only on how cheap the draft is",
            ],
            "answer": 1,
            "why": "α = 1 − TV(p, q) compares the draft with the target, not with the text: "
            "the closer q is to p, "
            "the more drafts pass. Distillation trains the draft for exactly that (the "
            "README gives measured "
            "acceptance figures, with their dates).",
        },
    ],
    "07b": [
        {
            "q": "A prompt-lookup draft proposes token x (its q puts all its mass on x). "
            "With what probability does "
            "the target's acceptance rule keep it?",
            "choices": [
                "p(x), the target's own probability of x",
                "1: the token is copied from the context, so it is always kept",
                "min(1, q(x) / p(x))",
            ],
            "answer": 0,
            "why": "The rule keeps x with probability min(1, p(x) / q(x)), and q(x) = 1 for a "
            "looked-up token; after "
            "a rejection the residual norm(max(0, p − q)) is p without x, "
            "renormalised. The output keeps exactly "
            "the target's distribution.",
        },
        {
            "q": "Medusa's typical acceptance keeps a candidate when the target gives it a "
            "high enough probability. "
            "Does the sampled output keep the target's distribution?",
            "choices": [
                "No: the rule trades exactness for longer accepted runs",
                "Yes: any rule that only keeps tokens the target finds likely is exact",
                "Only with Medusa-2",
            ],
            "answer": 0,
            "why": "Only the rejection rule (min(1, p/q), then the residual) reproduces p "
            "exactly; typical acceptance "
            "is a relaxation. Greedy verification, or Medusa's heads verified with the "
            "rejection rule, leave the "
            "output unchanged.",
        },
        {
            "q": "Why does speculative decoding gain less at large batch sizes?",
            "choices": [
                "Larger batches lower the acceptance rate α",
                "The verify pass's extra positions cost real time once a step is no "
                "longer memory-bound",
                "Every sequence in the batch needs a draft model of its own, whose "
                "weights crowd out the target's "
                "in the GPU's memory",
            ],
            "answer": 1,
            "why": "At batch 1 a step reads all the weights for little arithmetic, so scoring "
            "a few more positions is "
            "nearly free. A big batch already fills the arithmetic units: the extra "
            "positions of every sequence "
            "then cost time, and the spare compute speculation spends is gone.",
        },
    ],
    "08": [
        {
            "q": "A request's TTFT is 0.2 s and its TPOT 0.02 s. How long until its 101st token?",
            "choices": [
                "2.2 s: one prefill, then 100 decode steps",
                "2.22 s: one prefill, then 101 decode steps",
                "2.02 s: 101 decode steps, no prefill",
            ],
            "answer": 0,
            "why": "latency(N) = TTFT + (N - 1) x TPOT: the first token comes from the "
            "prefill, each later one from a "
            "decode step, so 0.2 + 100 x 0.02 = 2.2 s.",
        },
        {
            "q": "Continuous batching admits new requests as others finish instead of "
            "waiting for the whole batch.",
            "choices": TF,
            "answer": 0,
            "why": "Short requests leave the batch early and free slots are refilled at once, "
            "raising throughput and "
            "cutting queueing latency on mixed workloads.",
        },
        {
            "q": "Why does one decode step of 32 rows cost far less than 32 decode steps of "
            "one row?",
            "choices": [
                "The weights are read once per step, however many rows use them",
                "The 32 rows share one KV cache, so attention runs once for all of them",
                "A batched step samples one token and copies it to the other rows",
            ],
            "answer": 0,
            "why": "A batch-1 decode step spends its time reading the weights (it is "
            "memory-bound); B rows reuse that "
            "one read, so the arithmetic grows with B and the weight traffic does not. "
            "Each row keeps its own KV "
            "cache and samples its own token.",
        },
        {
            "q": "In one batched decode step, row i holds lengths[i] = 5 cached positions. "
            "Which keys may its new "
            "token attend to?",
            "choices": [
                "Keys 0 to 5 of its own row: its past and itself",
                "Keys 0 to 4 of its own row: its past only",
                "Keys 0 to the longest row's length, like every row",
            ],
            "answer": 0,
            "why": "The new token sits at position lengths[i] = 5 and sees positions 0..5 of "
            "its own row; keys past "
            "its row's length are another request's leftovers or unused space.",
        },
    ],
    "08b": [
        {
            "q": "Streams that slow down as they go are most likely caused by:",
            "choices": [
                "The sampler: top-p sorts more candidates as the text grows",
                "Context growth: every new token attends to all the positions before it",
                "Prompt caching: the cached prefix is copied at every step",
            ],
            "answer": 1,
            "why": "Per-token attention cost grows with the context; plot per-token latency "
            "against position. The "
            "vocabulary a sampler sorts never grows, and a cached prefix is copied "
            "once per request.",
        },
        {
            "q": "Reusing the KV cache of a shared system prompt changes the generated tokens.",
            "choices": TF,
            "answer": 1,
            "why": "The prefix's keys and values are the same whoever computes them; only "
            "TTFT changes.",
        },
        {
            "q": "With blocks of 16 positions, how many blocks does a request of 33 "
            "positions hold, and how many "
            "positions of them are empty?",
            "choices": ["2 blocks, none empty", "3 blocks, 15 empty", "3 blocks, 1 empty"],
            "answer": 1,
            "why": "ceil(33 / 16) = 3 blocks of 48 positions; only the last block is partly "
            "filled (1 of 16), so 15 "
            "are empty: the waste of paging is under one block per request.",
        },
        {
            "q": "Under continuous batching, a request with a long prompt is admitted and "
            "every running stream "
            "stalls for one token. Which remedy bounds that stall?",
            "choices": [
                "Chunked prefill: prefill it in pieces that share steps with the decodes",
                "A larger KV block size, so that the long prompt's keys take fewer blocks",
                "Static batching: admit it only once every running request is done",
            ],
            "answer": 0,
            "why": "The stall is the new request's prefill, run before the next decode step. "
            "Chunked prefill caps the "
            "prefill work in each step (vLLM's V1 engine does it by default); a block "
            "size changes memory, not "
            "work; static batching avoids the stall only by making the queue wait far longer.",
        },
    ],
    "09": [
        {
            "q": "A batch-1 decode step of a large model is memory-bound. Storing its "
            "weights in int8 instead of fp16 "
            "predicts what speedup, if the kernels keep up?",
            "choices": [
                "About 2×: the step reads half the weight bytes",
                "About 4×: int8 arithmetic is four times cheaper",
                "None: the number of FLOPs per token is unchanged",
            ],
            "answer": 0,
            "why": "A memory-bound step takes about bytes / bandwidth; int8 halves fp16's "
            "bytes. The FLOPs are the "
            "same, but they were not the limit.",
        },
        {
            "q": "With symmetric absmax quantization, scale = max |w| / 127, the largest "
            "rounding error of any "
            "weight is:",
            "choices": ["scale / 2", "scale", "max |w| / 2"],
            "answer": 0,
            "why": "q = round(w / scale) picks the nearest level, and levels are one scale "
            "apart, so no weight is "
            "more than half a step from its level; nothing is clipped because max |w| "
            "maps to ±127 exactly.",
        },
        {
            "q": "One weight in a row is 20 times larger than the rest. Which choice limits "
            "the damage to the fewest "
            "other weights?",
            "choices": [
                "One scale for the whole tensor",
                "One scale per output row",
                "One scale per group of 32 input columns",
            ],
            "answer": 2,
            "why": "A scale is set by the largest weight that shares it: per tensor every "
            "weight is coarsened, per "
            "row that row, per group only the outlier's 31 neighbours.",
        },
        {
            "q": "On some CPU, an int4 kernel reads its weights at 5 GB/s while fp32's "
            "matrix-vector product reads "
            "16 GB/s, and int4 decoding is far slower than its 6× fewer bytes predict. Why?",
            "choices": [
                "The kernel's own work per byte (unpacking, widening, scaling), not "
                "memory, became the limit",
                "int4 weights do not fit in the CPU cache, so they are read twice",
                "The roofline counts bytes wrongly for integers",
            ],
            "answer": 0,
            "why": "Per byte the int4 kernel streams far more slowly than fp32's product, "
            "from the same memory: each "
            "weight is unpacked, widened and scaled before it is multiplied. Its "
            "speedup per weight is then its byte "
            "ratio times its share of fp32's bytes per second; chapter 09 times the "
            "kernels from main memory on your "
            "CPU to see which holds there.",
        },
        {
            "q": "An int4 copy of a model, used as the draft for the full-precision model "
            "in speculative decoding, "
            "changes the generated text slightly.",
            "choices": TF,
            "answer": 1,
            "why": "Speculative decoding is exact whatever the draft (chapter 07): the text "
            "has the target's "
            "distribution. The quantized draft's high α (near 1) only makes it fast "
            "where its step is cheap.",
        },
        {
            "q": "The course model is 13 MB in fp32, less than a typical CPU's last-level "
            "cache. Why is the "
            "roofline's byte ratio a poor prediction of its int8 decode speedup on a CPU?",
            "choices": [
                "Its weights are read from the cache after the first steps, so memory "
                "bandwidth is not the limit",
                "int8 rounding makes it generate longer replies",
                "Its weights are already stored in 8 bits",
            ],
            "answer": 0,
            "why": "A model that fits in the last-level cache is read from the cache, not "
            "from main memory; the "
            "per-step overhead (Python, dozens of small kernels) and the kernels' own "
            "work then weigh as much as "
            "the bytes, so its measured speedup follows the machine's caches and "
            "overheads, not the ratio.",
        },
    ],
    "08c": [
        {
            "q": "A server prefills each new prompt whole between two decode steps. A 768-token "
            "document arrives while eight chats stream. What do the chats see?",
            "choices": [
                "Nothing: the document's prefill runs in parallel with their decode steps",
                "One gap between two of their tokens as long as the document's whole prefill",
                "Every later token slower, for as long as the document is in the batch",
            ],
            "answer": 1,
            "why": "The step that admits the document runs its prefill before the next decode "
            "step: every running request waits for it once. Chunking spreads that wait over "
            "many steps, each at most a chunk's work.",
        },
        {
            "q": "Chunked prefill with a smaller chunk...",
            "choices": [
                "lowers the worst gap between running requests' tokens and delays the long "
                "prompt's first token",
                "lowers both the worst gap and the long prompt's time to first token",
                "changes the tokens a request gets",
            ],
            "answer": 0,
            "why": "Each step carries less prompt work, so running requests wait less, but the "
            "prompt needs more steps, each also paying for a decode step. The tokens are the "
            "same: the chunks compute the same keys, values and logits.",
        },
        {
            "q": "A router picks 2 of 8 experts for a token. How are the two experts' outputs "
            "weighted in Mixtral's layer?",
            "choices": [
                "By the softmax over all 8 logits, taken at the two chosen experts",
                "By the softmax over the two chosen logits: the two weights sum to 1",
                "Equally, one half each",
            ],
            "answer": 1,
            "why": "Equivalently, the softmax over all 8 renormalised over the chosen two. Left "
            "unnormalised, a token whose logits are spread gets a smaller output than one whose "
            "router is sure.",
        },
        {
            "q": "A mixture of 8 experts, 2 per token, decodes a batch of 16. Compared with "
            "batch 1, its step reads...",
            "choices": [
                "the same weights: decode reads every weight once per step, whatever the batch",
                "about 4 times the expert weights: nearly all 8 experts instead of 2",
                "16 times the expert weights: 2 per token",
            ],
            "answer": 1,
            "why": "Each chosen expert is read once for all the rows that chose it; 16 tokens "
            "touch E (1 - (1 - k/E)^16) = 7.9 of 8 experts on average with uniform routing.",
        },
    ],
    "09b": [
        {
            "q": "Two int4 copies of a layer have the same weight error ||W' - W||. Which one "
            "should an engine prefer?",
            "choices": [
                "Either: the same weight error means the same damage to the model",
                "The one with the smaller trace((W' - W) H (W' - W)^T), H = mean x x^T of its "
                "inputs",
                "The one whose errors fall on the smallest weights",
            ],
            "answer": 1,
            "why": "The next layer sees y = W x, not W. An error along a direction the inputs "
            "rarely take costs little; one that meets a loud channel costs a lot. H weighs them.",
        },
        {
            "q": "GPTQ has rounded column i. What does it do with that column's rounding error?",
            "choices": [
                "Moves the columns not yet rounded to cancel it on the calibration inputs",
                "Adds it to the column's bias",
                "Spreads it evenly over the other weights of the same group",
            ],
            "answer": 0,
            "why": "The later columns are re-fit by least squares with the rounded ones fixed: "
            "e = (w_i - w^_i) / U_ii and W[:, i+1:] -= e U[i, i+1:], U the upper Cholesky "
            "factor of the damped inverse H.",
        },
        {
            "q": "AWQ multiplies input column c of W by s_c. What keeps the layer's function "
            "the same, and what does it cost at inference?",
            "choices": [
                "Nothing needs to: the rounding absorbs the scale",
                "A division of x by s, run before every product as an extra operation",
                "x divided by s, folded into the operation that makes x (a norm's weight, the "
                "value rows), so nothing extra runs",
            ],
            "answer": 2,
            "why": "The division moves into the weights of the op before, exactly; where none "
            "exists (after GELU) AWQ's code adds a scaling operation or leaves s = 1.",
        },
        {
            "q": "At 8 bits a floating-point format (E4M3) stores these weights more precisely "
            "than int8 with a scale per row.",
            "choices": TF,
            "answer": 1,
            "why": "int8 has 255 even levels across the row; E4M3's 3 mantissa bits space its "
            "values 6 to 12.5 % apart at every size. Chapter 09b measures int8's relative "
            "error below E4M3's; FP8's case is tensor cores and activations' range.",
        },
    ],
    "10": [
        {
            "q": "Reading a row in chunks, the running maximum grows from m to m'. What happens "
            "to the running sum l of exp(x - m)?",
            "choices": [
                "Nothing: the new chunk's terms are added to it as they are",
                "It is recomputed from the whole row seen so far",
                "It is multiplied by exp(m - m') before the new chunk's terms are added",
            ],
            "answer": 2,
            "why": "Its terms were taken against the old maximum; exp(m - m') <= 1 moves them "
            "onto the new one, so the sum never needs the earlier values again.",
        },
        {
            "q": "Causal tiled attention skips a key tile when its first key comes after which "
            "query of the query tile?",
            "choices": [
                "The tile's first query: no query of the tile sees any of its keys",
                "The tile's last query: no query of the tile sees any of its keys",
                "Any query of the tile: the diagonal runs through that key tile",
            ],
            "answer": 1,
            "why": "The last query sees the most keys. A key tile it cannot see is invisible to "
            "the whole query tile; one that starts after the first query but not the last "
            "crosses the diagonal and is masked, not skipped.",
        },
        {
            "q": "Split-K decode cuts a long cache into chunks, each returning its normalised "
            "output o_i and its log-sum-exp lse_i. How are the o_i combined?",
            "choices": [
                "Weighted by exp(lse_i - lse), lse the log-sum-exp of all the lse_i",
                "Averaged, each chunk counting 1 / (number of chunks)",
                "Weighted by each chunk's number of keys over the cache's length",
            ],
            "answer": 0,
            "why": "exp(lse_i - lse) is chunk i's share of the softmax's total mass; the chunks "
            "hold different shares whatever their lengths, so averaging is wrong.",
        },
        {
            "q": "Tiled attention approximates the softmax to save memory, so its output "
            "differs a little from the materialised way's.",
            "choices": TF,
            "answer": 1,
            "why": "It is exact: the running maximum and sum give the same normaliser, and the "
            "unnormalised output is rescaled the same way; the two differ only by rounding, as "
            "chapter 10's checks against PyTorch's attention show.",
        },
    ],
    "11": [
        {
            "q": "RoPE rotates a query at position p and a key at position j. Their dot product "
            "then depends on:",
            "choices": [
                "p and j separately, like a learned position table",
                "only the distance p - j",
                "only the larger of p and j",
            ],
            "answer": 1,
            "why": "Each pair of dimensions turns by an angle proportional to the position; the "
            "dot product of two rotated vectors depends on the difference of their angles, "
            "(p - j) times the pair's frequency.",
        },
        {
            "q": "A model has 32 query heads and 8 key/value heads. With GQA, which KV head does "
            "query head 13 read?",
            "choices": ["Head 13 // 4 = 3", "Head 13 % 8 = 5", "All 8, averaged"],
            "answer": 0,
            "why": "Groups of G = 32 / 8 = 4 consecutive query heads share a KV head: head h reads "
            "h // G, which is what k.repeat_interleave(G, dim=1) lines up.",
        },
        {
            "q": "Where must a decode step's new key be rotated?",
            "choices": [
                "At position 0, since it is the only new token",
                "At its own position, before it goes into the cache",
                "Not at all: the cache rotates every key when a query reads it",
            ],
            "answer": 1,
            "why": "The cache stores keys already rotated at the positions they were written at; a "
            "key rotated at 0 would look to every later query as if it were at the start.",
        },
        {
            "q": "Chapter 11's modern model, run past its 1,024-position training window with a "
            "full cache, loses more than with a 512-position sliding window. Why?",
            "choices": [
                "The full cache runs out of memory and drops keys",
                "Its queries meet distances the model never trained on; the window keeps every "
                "distance below 512",
                "The window adds attention sinks automatically",
            ],
            "answer": 1,
            "why": "Rotary scores depend on distance; distances above 1,023 never occurred in "
            "training. The window trades the far context for distances the model knows.",
        },
    ],
}
