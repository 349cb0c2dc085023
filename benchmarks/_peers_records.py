"""The records of `bench_peers.py` (JSON), read back from its markdown tables too, and
the plot drawn from them.

Records: `{"runs": [run, ...]}`, the newest run first. A run:

    {"section": "2026-12-06, later: ...", "title": "Python 3.11, the jax it resolves",
     "environment": "Python 3.11.7, jax 0.10.2, ...; x86_64, 1 cpu device(s)",
     "problem": "seq 4096, batch 1, 4 heads, dim 64, float32; medians of 7 ...",
     "memory_seq": 16384,
     "rows": [{"impl": "eqx_flash", "ms": {"fwd": 56.0, ...}, "temp_mib": 79.0}, ...]}

`plot` draws the runs of the newest section: for each, the time of every implementation
in every mode (log scale) and the compiled temporary memory of a causal forward+backward.
"""

import json
import pathlib
import re
from typing import Any

MODES = ("fwd", "fwd causal", "fwd+bwd", "fwd+bwd causal")


def save(records: dict[str, Any], path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")


def load(path: pathlib.Path) -> dict[str, Any]:
    records = json.loads(path.read_text())
    if not records.get("runs"):
        raise ValueError(f"{path} holds no runs")
    return records


def records_from_markdown(text: str) -> dict[str, Any]:
    """The runs of `peers_results.md`-style markdown: each table under a `## ` section
    (and a `### ` title), with the environment and problem lines before it."""
    runs: list[dict[str, Any]] = []
    section = title = environment = problem = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section, title = line[3:].strip(), ""
        elif line.startswith("### "):
            title = line[4:].strip()
        elif line.startswith("Python ") and " jax " in line:
            environment = line.strip()
        elif re.match(r"seq \d+, batch", line):
            problem = line.strip()
        elif line.startswith("| impl |"):
            header = [c.strip() for c in line.strip("|").split("|")]
            memory = re.search(r"temp at seq (\d+)", header[-1])
            rows, i = [], i + 2  # past the header's |---| line
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_row(header, lines[i]))
                i += 1
            runs.append({"section": section, "title": title, "environment": environment,
                         "problem": problem,
                         "memory_seq": int(memory.group(1)) if memory else None,
                         "rows": rows})
            continue
        i += 1
    if not runs:
        raise ValueError("no `| impl |` table found")
    return {"runs": runs}


def _row(header: list[str], line: str) -> dict[str, Any]:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    row: dict[str, Any] = {"impl": cells[0], "ms": {}}
    for name, cell in zip(header[1:], cells[1:], strict=True):
        number = float(cell.split()[0])  # "56 (0.69 of peak)", "5.32x" after it, "79 MiB"
        if name in MODES:
            row["ms"][name] = number
        else:
            row["temp_mib"] = number
    return row


def plot(records: dict[str, Any], path: pathlib.Path) -> None:
    """The newest section's runs, one row of two panels each: time per mode, memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest = records["runs"][0]["section"]
    runs = [run for run in records["runs"] if run["section"] == newest]
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.8 * len(runs)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1.3]})
    for run, (ax_time, ax_memory) in zip(runs, axes, strict=True):
        rows = run["rows"]
        width = 0.8 / len(rows)
        for j, row in enumerate(rows):
            xs = [m + (j - (len(rows) - 1) / 2) * width for m in range(len(MODES))]
            ax_time.bar(xs, [row["ms"].get(mode, float("nan")) for mode in MODES], width,
                        label=row["impl"], color=f"C{j}",
                        edgecolor="black" if row["impl"] == "eqx_flash" else None)
        ax_time.set_xticks(range(len(MODES)), MODES)
        ax_time.set_yscale("log")
        ax_time.set_ylabel("time (ms, log scale; lower is faster)")
        ax_time.grid(True, axis="y", which="both", alpha=0.3)
        ax_time.set_title(run["environment"].split(";")[0], fontsize=9)
        memory = [(row["impl"], row["temp_mib"]) for row in rows if "temp_mib" in row]
        ax_memory.barh([name for name, _ in memory], [mib for _, mib in memory],
                       color=[f"C{j}" for j in range(len(memory))])
        ax_memory.set_xscale("log")
        ax_memory.invert_yaxis()
        ax_memory.set_xlabel(f"MiB, causal fwd+bwd at seq {run['memory_seq']}")
        ax_memory.tick_params(axis="y", labelsize=8)
        ax_memory.set_title("compiled temporaries", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    problem = runs[0]["problem"].split(";")[0]
    fig.suptitle(f"eqx_flash and the JAX attention peers on CPU ({problem})", fontsize=10)
    fig.tight_layout(rect=(0, 0.17 / len(runs), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
