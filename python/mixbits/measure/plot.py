"""Heatmaps of a sensitivity table: log10 KL per (layer, tensor kind) for
each candidate, and, given an allocation, the chosen bits per tensor (the
chosen kinds, when kinds of one width are among them)."""

from __future__ import annotations

import math

import numpy as np


def _column(e) -> str:
    """Block index, or "out" for tensors outside the blocks (embeddings, head)."""
    return str(e["layer"]) if e.get("layer") is not None else "out"


def _grid(entries, value_of):
    kinds, layers = [], []
    for e in entries:
        k = e["path"].rsplit(".", 1)[-1]
        if k not in kinds:
            kinds.append(k)
        if _column(e) not in layers:
            layers.append(_column(e))
    layers.sort(key=lambda c: (c == "out", int(c) if c != "out" else 0))
    g = np.full((len(kinds), len(layers)), np.nan)
    for e in entries:
        v = value_of(e)
        if v is not None:
            g[kinds.index(e["path"].rsplit(".", 1)[-1]), layers.index(_column(e))] = v
    return g, kinds, layers


def plot_table(table: dict, out, allocation: dict | None = None, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = table["entries"]
    if not entries:
        raise ValueError("the table has no entries to plot")
    cand_names = [c["kind"] for c in entries[0]["candidates"]]
    panels = len(cand_names) + (1 if allocation else 0)
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.8 * rows + 0.6), squeeze=False,
                             layout="constrained")
    floor = 1e-7
    kl_all = [max(c["kl"], floor) for e in entries for c in e["candidates"]]
    vmin, vmax = math.log10(min(kl_all)), math.log10(max(kl_all))
    im = None
    for ax, name in zip(axes.flat, cand_names):
        def kl_of(e, name=name):
            for c in e["candidates"]:
                if c["kind"] == name:
                    return math.log10(max(c["kl"], floor))
            return None

        g, kinds, layers = _grid(entries, kl_of)
        im = ax.imshow(g, aspect="auto", cmap="magma", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(f"{name}: log10 KL")
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
        ax.set_xlabel("layer")
        step = max(1, len(layers) // 10)
        ax.set_xticks(range(0, len(layers), step), layers[::step], fontsize=7)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist()[: len(cand_names)], shrink=0.8)
    if allocation:
        ax = axes.flat[len(cand_names)]
        assignment = allocation["assignment"]
        bits = {a["path"]: a["bits"] for a in assignment}
        chosen = _chosen_kinds(assignment)
        if chosen:  # kinds of one width (mxfp4 and 4b_g64 are both 4 bits): one colour per kind
            index = {p: chosen.index(a["kind"]) for p, a in ((a["path"], a) for a in assignment)}
            g, kinds, layers = _grid(entries, lambda e: index.get(e["path"]))
            cmap = plt.get_cmap("tab10" if len(chosen) <= 10 else "tab20", len(chosen))
            im2 = ax.imshow(g, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(chosen) - 0.5,
                            interpolation="nearest")
            what = "chosen kinds"
        else:
            g, kinds, layers = _grid(entries, lambda e: bits.get(e["path"]))
            im2 = ax.imshow(g, aspect="auto", cmap="viridis", interpolation="nearest")
            what = "chosen bits"
        storage, avg = allocation.get("average_bpw_storage"), allocation.get("average_bits")
        ax.set_title(what + (f" ({storage:.3f} bpw as stored)" if storage
                             else f" (avg {avg:.3f})" if avg else ""))
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
        ax.set_xlabel("layer")
        step = max(1, len(layers) // 10)  # as the KL panels label their columns ("out" included)
        ax.set_xticks(range(0, len(layers), step), layers[::step], fontsize=7)
        bar = fig.colorbar(im2, ax=ax, shrink=0.8)
        if chosen:
            bar.set_ticks(range(len(chosen)), labels=chosen)
    for ax in list(axes.flat)[panels:]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _chosen_kinds(assignment) -> list[str] | None:
    """The allocation's kinds, by width then name, when two of them share a
    width (bits alone would draw them alike: an fp mode beside the affine
    kind of its width, or two group sizes); None otherwise."""
    widths = {}
    for a in assignment:
        if not isinstance(a.get("kind"), str):
            return None
        widths[a["kind"]] = a["bits"]
    if len(set(widths.values())) == len(widths):
        return None
    return sorted(widths, key=lambda k: (widths[k], k))
