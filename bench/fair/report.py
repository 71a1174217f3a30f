"""The fairness experiment's table (markdown, every arm and every bar, pass or fail) and plot."""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg")  # no display: render straight to a file
import matplotlib.pyplot as plt

from bench.fair.arm import ArmResult

DEMAND_BAR = 0.90
WAIT_RATIO_BAR = 1.20
THROUGHPUT_BAR = 0.05
FAILOVER_POINTS_BAR = 2.0
WEIGHT_BAR = 0.10


def _verdict(ok: bool | None) -> str:
    return "reference" if ok is None else "PASS" if ok else "FAIL"


def _largest_move(a: ArmResult, b: ArmResult) -> float:
    """The largest change of a tenant's share between two arms, in points."""
    return max(abs(a.share(n) - b.share(n)) * 100 for n in a.tenants)


def bars(results: Mapping[str, ArmResult]) -> list[tuple[str, str, bool | None]]:
    """(bar, measured, passed) for every bar whose arms ran (passed None: a reference figure,
    not a bar)."""
    out: list[tuple[str, str, bool | None]] = []
    fair, fifo = results.get("fair"), results.get("fifo")
    alone, failover = results.get("alone"), results.get("failover")
    if fair is not None:
        for n in ("B", "C"):
            met = fair.tenants[n].demand_met
            out.append((f"fair: {n} gets >= 90% of its demand", f"{met:.1%}", met >= DEMAND_BAR))
    if fair is not None and alone is not None:
        for n in ("B", "C"):
            mine, other = fair.tenants[n], alone.tenants[n]
            with_a, without = mine.wait_p(0.99), other.wait_p(0.99)
            shown = f": x{with_a / without:.2f}" if without > 0 else ""
            out.append((f"fair: {n}'s P99 queue wait <= 1.2x alone's",
                        f"{with_a:.0f} ms vs {without:.0f} ms{shown} (queued {mine.queued} of "
                        f"{len(mine.waits_ms)} vs {other.queued} of {len(other.waits_ms)})",
                        with_a <= WAIT_RATIO_BAR * without))
    if fair is not None and fifo is not None:
        change = fair.throughput_tps / fifo.throughput_tps - 1
        done = fair.completed_tps / fifo.completed_tps - 1 if fifo.completed_tps else 0.0
        out.append(("fair: pool throughput (tokens the engines computed) within 5% of fifo's",
                    f"{fair.throughput_tps:.0f} vs {fifo.throughput_tps:.0f} tok/s: "
                    f"{change:+.1%}", abs(change) <= THROUGHPUT_BAR))
        out.append(("fair: tokens of requests completed in the window, against fifo's",
                    f"{fair.completed_tps:.0f} vs {fifo.completed_tps:.0f} tok/s: {done:+.1%}",
                    None))
    if fair is not None and failover is not None:
        moved = _largest_move(failover, fair)
        out.append(("failover: no share moves more than 2 points",
                    f"largest move {moved:.2f} points", moved <= FAILOVER_POINTS_BAR))
    again = results.get("fair-again")
    if fair is not None and again is not None:
        out.append(("fair run again, unchanged: largest share move (the noise floor)",
                    f"{_largest_move(again, fair):.2f} points", None))
        if failover is not None:
            out.append(("failover against fair-again: largest share move",
                        f"{_largest_move(failover, again):.2f} points", None))
    weighted = results.get("weighted")
    if weighted is not None:
        d, e = weighted.tenants["D"].service_tokens, weighted.tenants["E"].service_tokens
        ratio = d / e if e else float("inf")
        out.append(("weighted: service within 10% of 3:1", f"{ratio:.2f}:1",
                    abs(ratio / 3 - 1) <= WEIGHT_BAR))
    return out


def markdown(results: Mapping[str, ArmResult], *, seed: int, command: str, capacity_rps: float,
             flood: float, light: float, window: tuple[float, float]) -> str:
    lines = [
        f"# Fairness within a tier: noisy neighbour, FIFO against fair (seed {seed})",
        "",
        f"Command: `{command}`. Two simulated nodes (quarter size, clock x8), two gateways, two "
        f"schedulers, one Redis per arm; one request shape (forced output, so a reservation "
        f"is what it uses). The pool completes about {capacity_rps:g} requests/s; a tenant's "
        f"share is a third of it. A sends {flood:g}x its share, B and C {light:.0%} of theirs. "
        f"Figures count wall seconds {window[0]:g}-{window[1]:g} of each arm.",
        "",
        "| bar | measured | |",
        "|---|---|---|",
        *(f"| {b} | {m} | {_verdict(ok)} |" for b, m, ok in bars(results)),
        "",
        "| arm | tenant | weight | sent | demand met | share of service | queue wait P50 "
        "| P99 | pool tok/s | completed tok/s | send lag max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        weights = {t.name: t.weight for t in r.spec.tenants}
        for n, t in r.tenants.items():
            lines.append(f"| {name} | {n} | {weights[n]:g} | {t.sent} | {t.demand_met:.1%} | "
                         f"{r.share(n):.3f} | {t.wait_p(0.5):.0f} ms | {t.wait_p(0.99):.0f} ms | "
                         f"{r.throughput_tps:.0f} | {r.completed_tps:.0f} | "
                         f"{r.max_send_lateness_s * 1000:.0f} ms |")
        if r.killed:
            lines.append(f"| {name} | (leader {r.killed} killed at the window's middle) "
                         "| | | | | | | | | |")
    lines.append("")
    return "\n".join(lines)


def plot(results: Mapping[str, ArmResult], path: object, bin_s: float) -> None:
    """Tokens released per second per tenant over each arm, one panel per arm."""
    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        r = results[name]
        for tenant, series in r.series.items():
            ax.plot([bin_s * (i + 0.5) for i in range(len(series))], series, label=tenant)
        if r.spec.failover_at_s is not None:
            ax.axvline(r.spec.failover_at_s, color="black", linestyle=":", label="leader killed")
        ax.set_title(name)
        ax.set_xlabel("wall s")
        ax.set_ylabel("tokens released / s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), dpi=90)
    plt.close(fig)
