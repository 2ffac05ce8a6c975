"""The README's checkpoint table, from the training record stored inside each shipped checkpoint
(written by ``python -m ar_lab.bench.readme`` with the benchmark table)."""

from __future__ import annotations

from pathlib import Path


def checkpoint_table(paths: list[Path]) -> str:
    """The README's checkpoint table, from the training record inside each checkpoint."""
    from ar_lab.model.checkpoint import read_checkpoint_metadata
    from ar_lab.model.evaluation import COURSE_EVAL

    notes = []
    lines = [
        "| checkpoint | parameters | layers × width, heads | trained on | validation loss "
        f"(`{COURSE_EVAL.name}`) | training time |",
        "|---|---|---|---|---|---|",
    ]
    for path in paths:
        meta = read_checkpoint_metadata(path)
        cfg, rec = meta["config"], meta["record"]
        phases = rec["phases"]
        taught = [i + 1 for i, p in enumerate(phases) if p.get("teacher")]
        how = f"{len(phases)} phases, {rec['train_steps']:,} steps"
        if taught:
            how += (
                f"; phase {', '.join(map(str, taught))} distils the "
                f"{phases[taught[0] - 1]['teacher']} model"
            )
            t = taught[0]
            if t > 1 and phases[t - 2].get("val_curve") and phases[t - 1].get("val_curve"):
                notes.append(
                    f"`{path.name}`'s loss on the text as the trainer tracked it (its running "
                    "estimate on random validation windows, not the protocol of the table): "
                    f"{phases[t - 2]['val_curve'][-1]:.2f} nats at the end of phase {t - 1}, "
                    f"{phases[t - 1]['val_curve'][-1]:.2f} after the distillation of phase {t}."
                )
        halves = rec.get("val_halves_nats")
        by_half = (
            f" (positions 0–511: {halves[0]:.2f}, 512–1,023: {halves[1]:.2f})" if halves else ""
        )
        lines.append(
            f"| `{path.name}` | {rec['parameters']:,} | {cfg['n_layer']} × {cfg['n_embd']}, "
            f"{_heads(cfg)} | {rec['train_tokens'] / 1e6:.1f} M tokens ({how}) | "
            f"{rec['val_loss_nats']:.3f} nats = {rec['val_bits_per_byte']:.2f} bits/byte{by_half}"
            f" | {rec['train_seconds'] / 60:.0f} min, {_threads(phases, rec['threads'])}, torch "
            f"{rec['torch']} |"
        )
    return "\n".join(lines + ([""] + notes if notes else []))


def _heads(cfg: dict) -> str:
    """"4 heads", or for a Llama-shaped block "4 heads (2 KV); RMSNorm, RoPE, SwiGLU"."""
    kv = cfg.get("n_kv_heads")
    text = f"{cfg['n_head']} heads" + (f" ({kv} KV)" if kv not in (None, cfg["n_head"]) else "")
    modern = [
        name
        for key, value, name in (
            ("norm", "rmsnorm", "RMSNorm"),
            ("positions", "rope", "RoPE"),
            ("mlp", "swiglu", "SwiGLU"),
        )
        if cfg.get(key) == value
    ]
    return text + (f"; {', '.join(modern)}" if modern else "")


def _threads(phases: list[dict], default: int) -> str:
    """"2 threads", or per phase where the phases differ ("phases 1-3: 1 thread; phase 4: 2
    threads")."""
    counts = [p.get("threads", default) for p in phases]

    def word(n: int) -> str:
        return f"{n} thread{'s' if n != 1 else ''}"

    if len(set(counts)) <= 1:
        return word(counts[0] if counts else default)
    runs, start = [], 0
    for i in range(1, len(counts) + 1):
        if i == len(counts) or counts[i] != counts[start]:
            which = f"phase {start + 1}" if i - start == 1 else f"phases {start + 1}–{i}"
            runs.append(f"{which}: {word(counts[start])}")
            start = i
    return "; ".join(runs)
