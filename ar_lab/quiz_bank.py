"""Self-check questions, one short quiz per chapter (shown by ``ar_lab.quiz.show``).

Each question: the prompt, the choices, the index of the right one, and an
explanation shown after an attempt (right or wrong). True/false questions have the
choices ["True", "False"].
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
                "Edit the test cell",
                "Replace `raise NotImplementedError()` in the exercise cell above with your code",
                "Skip the rest of the notebook",
            ],
            "answer": 1,
            "why": "Test cells are locked; the exercise cell above holds the stub to replace. Later cells use "
            "ar_lab's own version, so the rest of the chapter still runs.",
        },
        {
            "q": "Every notebook in the course runs on a CPU without a GPU.",
            "choices": TF,
            "answer": 0,
            "why": "Everything is sized for a laptop CPU or a free Binder; a GPU, when present, is used automatically.",
        },
    ],
    "01": [
        {
            "q": "Why is decoding sequential?",
            "choices": [
                "Because GPUs cannot run positions in parallel",
                "Because the input of step t+1 contains the token picked at step t, which does not exist earlier",
                "Because the causal mask forbids parallel computation",
            ],
            "answer": 1,
            "why": "Each new token depends on the previous one, so steps cannot overlap. Training is parallel "
            "because the whole text is known in advance; the causal mask is what makes that parallel pass honest.",
        },
        {
            "q": "The chain rule p(x1..xn) = Π p(xt | x<t) is an approximation that ignores long-range effects.",
            "choices": TF,
            "answer": 1,
            "why": "It is an exact identity of probability. Approximations come only from the model of each factor "
            "(a bigram model, for example, looks at one previous token).",
        },
        {
            "q": "A loop generates 50 tokens and then the model picks EOS. What happens?",
            "choices": ["It continues to max_new_tokens", "It stops; EOS is not part of the text", "It restarts"],
            "answer": 1,
            "why": "EOS (id 256 here) ends the text. ar_lab.generate reports stop_reason='eos'.",
        },
        {
            "q": "Why do we add log-probabilities instead of multiplying probabilities?",
            "choices": ["It is faster", "Products of many numbers below 1 underflow to 0.0", "Logs are more accurate"],
            "answer": 1,
            "why": "A product of hundreds of probabilities falls below the smallest float; a sum of logs does not.",
        },
    ],
    "02": [
        {
            "q": "What does the causal mask do during training?",
            "choices": [
                "Hides random tokens to regularise",
                "Stops each position from attending to later positions",
                "Removes padding",
            ],
            "answer": 1,
            "why": "Scores of future positions become -inf, so their weights are 0: training sees only the past, "
            "exactly as generation will.",
        },
        {
            "q": "Why divide attention scores by √d?",
            "choices": [
                "To keep the softmax from becoming nearly one-hot as the head size grows",
                "To normalise the values",
                "To make the mask work",
            ],
            "answer": 0,
            "why": "Dot products of d-dimensional vectors grow like √d; dividing keeps the scores' scale independent "
            "of d and the softmax trainable.",
        },
        {
            "q": "In multi-query attention (MQA) all query heads share one key/value head.",
            "choices": TF,
            "answer": 0,
            "why": "MQA: one K/V head; GQA: groups of query heads share a K/V head; MHA: one K/V head per query head.",
        },
    ],
    "03": [
        {
            "q": "The loss of a freshly initialised course model is close to:",
            "choices": ["0", "ln 257 ≈ 5.55 nats", "1 nat"],
            "answer": 1,
            "why": "An untrained model spreads probability almost evenly over 257 tokens: −ln(1/257) = ln 257.",
        },
        {
            "q": "Weight tying means:",
            "choices": [
                "All layers share weights",
                "The output layer reuses the token-embedding matrix",
                "Keys and values share weights",
            ],
            "answer": 1,
            "why": "GPT-2 ties the output projection to the token embedding, saving V × C parameters.",
        },
        {
            "q": "Our GPT gives the same logits as Hugging Face's GPT2LMHeadModel with the same weights.",
            "choices": TF,
            "answer": 0,
            "why": "The MHA configuration is exactly GPT-2's architecture; a test checks logits and greedy tokens.",
        },
    ],
    "04": [
        {
            "q": "Generating 1,000 tokens from a 1-token prompt without a KV cache processes how many positions?",
            "choices": ["1,000", "500,500", "1,000,000"],
            "answer": 1,
            "why": "Step n feeds n positions: 1 + 2 + … + 1,000 = 500,500. With a cache: 1 + 999 × 1 = 1,000.",
        },
        {
            "q": "Turning off the KV cache 'for safety' only costs a little time.",
            "choices": TF,
            "answer": 1,
            "why": "The work grows quadratically with length instead of linearly; chapter 04 measures the gap growing "
            "with the output length. The cache changes no output.",
        },
        {
            "q": "Which change shrinks the KV cache without shrinking the number of query heads?",
            "choices": ["More layers", "Grouped-query attention (fewer KV heads)", "A longer context"],
            "answer": 1,
            "why": "Cache bytes = layers × KV heads × head dim × sequence × batch × 2 × bytes per value.",
        },
        {
            "q": "A cached batch-1 decode step of the course model through GPT.forward() takes about twice as long as "
            "reading its weights. Where does most of the rest go?",
            "choices": [
                "The arithmetic of the matrix products",
                "Running one token through layers built for batches: module calls, many tiny kernels",
                "Copying the KV cache",
            ],
            "answer": 1,
            "why": "Chapter 04 measures it: the same arithmetic as direct tensor calls (ar_lab.lean) gives the same "
            "tokens with far less time above the weights-only floor; the preallocated cache copies nothing.",
        },
    ],
    "05": [
        {
            "q": "Decode at batch size 1 is usually limited by:",
            "choices": ["Arithmetic (FLOP/s)", "Memory bandwidth: all weights are read for one token", "Disk"],
            "answer": 1,
            "why": "One token does ~2 FLOPs per weight but reads every weight once: arithmetic intensity ~1 FLOP/byte "
            "(fp16), far below the ridge point.",
        },
        {
            "q": "The first token of a long prompt is slow, later tokens fast. Which fix targets this?",
            "choices": ["Caching the static prompt prefix", "A faster sampler", "Beam search"],
            "answer": 0,
            "why": "TTFT is prefill (compute-bound on the prompt): a prefix cache or a shorter prompt cuts it.",
        },
        {
            "q": "Batching more requests into one decode step moves it toward the compute roof.",
            "choices": TF,
            "answer": 0,
            "why": "The weights are read once for the whole batch, so FLOPs per byte grow with the batch size; but "
            "each sequence reads its own KV cache, so at long contexts the intensity levels off below a GPU's ridge.",
        },
        {
            "q": "'Generate 800 tokens' takes about the same time as processing an 800-token prompt.",
            "choices": TF,
            "answer": 1,
            "why": "Latency = TTFT + N × TPOT; 800 sequential decode steps each read all the weights, while a prompt "
            "is processed in one parallel pass.",
        },
    ],
    "06": [
        {
            "q": "Top-p with p = 0.9 keeps:",
            "choices": [
                "Tokens with probability ≥ 0.9",
                "The smallest set of most likely tokens whose mass reaches 0.9, including the one that crosses it",
                "The 90 % least likely tokens",
            ],
            "answer": 1,
            "why": "Nucleus sampling (Holtzman et al., 2020) keeps the head of the sorted distribution up to and "
            "including the token that makes the cumulative mass reach p.",
        },
        {
            "q": "Temperature 0 means:",
            "choices": ["Uniform sampling", "Greedy: always the most likely token", "An error"],
            "answer": 1,
            "why": "As T → 0 the softmax puts all mass on the argmax; ar_lab treats T below a small epsilon as greedy.",
        },
        {
            "q": "Changing the sampler changes the model's forward pass.",
            "choices": TF,
            "answer": 1,
            "why": "The logits are identical; only the pick from them changes.",
        },
    ],
    "07": [
        {
            "q": "Speculative decoding improves the quality of answers.",
            "choices": TF,
            "answer": 1,
            "why": "It is exact: its outputs have precisely the target model's distribution (a statistical test shows "
            "it). It changes speed, never quality.",
        },
        {
            "q": "When a draft token x is rejected, the replacement is drawn from:",
            "choices": ["The target distribution p", "norm(max(0, p − q))", "The draft distribution q"],
            "answer": 1,
            "why": "Resampling from the residual corrects exactly for the mass the draft over-proposed "
            "(Leviathan et al., 2023; Chen et al., 2023).",
        },
        {
            "q": "With acceptance rate α and γ drafts, the expected tokens per target call is:",
            "choices": ["γ·α", "(1 − α^(γ+1)) / (1 − α)", "1 / (1 − α)"],
            "answer": 1,
            "why": "Accepted prefix length is geometric, capped at γ, plus one token from the target (a correction or "
            "the bonus token).",
        },
        {
            "q": "Distilling the shipped draft from the course model made its loss on the text worse (1.49 -> 1.81 "
            "nats). What happened to the speculative speedup?",
            "choices": [
                "It fell: a worse model drafts worse",
                "It rose: α measures agreement with the target",
                "Nothing changed",
            ],
            "answer": 1,
            "why": "α = 1 − TV(p, q) compares the draft with the target, not with the text; distillation raised greedy "
            "α from 0.83 to 0.87 and the best speedup from 1.59x to 1.80x (chapter 07).",
        },
    ],
    "08": [
        {
            "q": "Streams that slow down as they go are most likely caused by:",
            "choices": ["The sampler", "Context growth: each token attends to more positions", "Prompt caching"],
            "answer": 1,
            "why": "Per-token attention cost grows with the context; plot per-token latency against position.",
        },
        {
            "q": "Continuous batching admits new requests as others finish instead of waiting for the whole batch.",
            "choices": TF,
            "answer": 0,
            "why": "Short requests leave the batch early and free slots are refilled at once, raising throughput and "
            "cutting queueing latency on mixed workloads.",
        },
        {
            "q": "Reusing the KV cache of a shared system prompt changes the generated tokens.",
            "choices": TF,
            "answer": 1,
            "why": "The prefix's keys and values are the same whoever computes them; only TTFT changes.",
        },
    ],
}
