"""The figures the README and docs/*.md state, checked against the files they come from.

Pure Python: no torch, no ranks, a fraction of a second. A page marks a checked
figure with an HTML comment right before the number, e.g.

    DistributedLion <!-- fig:s3-n2-vote-ms -->341 ms

and FIGURES below says how that figure follows from docs/benchmarks/*.json (or
from the code it counts). The number must equal the source's value rounded to
the decimals written. A few figures sit in sentences the tests find by their
wording or in tables they parse (suite 3 in docs/benchmarks.md). The
README's `make demo` / `make test` times come from
docs/benchmarks/test_durations.json, one entry per machine measured on. Also: the README stays within 250 lines,
docs/benchmarks.md within 500, and every relative link of the README and
docs/*.md leads to a file (and heading) that exists.
"""

import functools
import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCH = DOCS / "benchmarks"
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))

MARKER = re.compile(r"<!-- fig:([a-z0-9-]+) -->")
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
N2_RUNS = ("training-n2-run1.json", "training-n2-run2.json", "training-n2-run3.json")


def rel(path):
    return path.relative_to(ROOT).as_posix()


@functools.cache
def load(name):
    with open(BENCH / name) as f:
        return json.load(f)


def result(name, impl, **where):
    """The one result of `impl` in a benchmark JSON (filtered by `where`)."""
    rows = [r for r in load(name)["results"] if r.get("impl") == impl and all(r.get(k) == v for k, v in where.items())]
    assert len(rows) == 1, f"{name}: {len(rows)} results for {impl} {where}"
    return rows[0]


def n2(impl, key="median_s"):
    """`key` of `impl` in each of the three N = 2 runs of suite 3."""
    return [result(run, impl)[key] for run in N2_RUNS]


def n2_ratio(impl, over):
    """Each run's `impl` step over the same run's `over` step (how docs/benchmarks.md forms ratios)."""
    return [a / b for a, b in zip(n2(impl), n2(over))]


def n4(impl, key="median_s"):
    return result("training-n4.json", impl)[key]


def s1_speedup(name, world_size, numel):
    """Suite 1: Gloo fp32 all-reduce time over the vote's, 1 Gbit/s."""
    at = dict(world_size=world_size, numel=numel, link="1gbit")
    return result(name, "gloo_fp32", **at)["median_s"] / result(name, "lionbit_vote", **at)["median_s"]


def levers(impl, key):
    return result("training-levers.json", impl)[key]


def over_vote(impl, key="bytes_per_rank"):
    """Suite 3's levers run (N = 4, 100 steps): `impl`'s bytes over the vote's."""
    return levers(impl, key) / levers("distlion_vote", key)


def gpu_only_files():
    """The files tools/gpu_only_lines.sh counts (its `files=( ... )` list)."""
    text = (ROOT / "tools" / "gpu_only_lines.sh").read_text()
    m = re.search(r"^files=\((.*?)^\)", text, re.S | re.M)
    assert m, "tools/gpu_only_lines.sh: no files=( ... ) list"
    return m.group(1).split()


def gpu_only_lines():
    """What tools/gpu_only_lines.sh prints as its total: lines that are not blank or only a // comment."""
    total = 0
    for name in gpu_only_files():
        path = ROOT / name
        assert path.is_file(), f"tools/gpu_only_lines.sh lists {name}, which does not exist"
        lines = path.read_text().rstrip("\n").split("\n")
        total += sum(1 for line in lines if not re.fullmatch(r"[ \t\r\f\v]*(//.*)?", line))
    return total


def bad_input_rows():
    return len(re.findall(r"^\| \d+ \|", (DOCS / "bad-input.md").read_text(), re.M))


def bad_input_tests(cases):
    text = (ROOT / "tests" / "python" / "test_bad_input.py").read_text()
    if cases:
        return len(re.findall(r"^def case_\w+", text, re.M))
    return len([t for t in re.findall(r"^def (test_\w+)", text, re.M) if t != "test_case"])


def s5_link(n, method, key="seconds_per_step"):
    """Suite 5 (time to quality): a method's run on the emulated link at N = n, seed 0."""
    rows = [r for r in load(f"time_to_target/link-n{n}.json")["results"] if r["method"] == method]
    assert len(rows) == 1, f"time_to_target/link-n{n}.json: {len(rows)} runs of {method}"
    return rows[0]["reached"]["seconds"] if key == "end_to_end_s" else rows[0][key]


def s5_seconds(n, method):
    """Suite 5: mean steps to target over seeds 0-2 x the link's s/step. Steps: phase steps-nN
    (seeds 1-2), the link run (seed 0) and at N = 2 AdamW + fp32's target runs, cut at the
    target (its mean validation loss at half the schedule, rounded up to 0.01)."""
    runs = [r for r in load(f"time_to_target/steps-n{n}.json")["results"] if r["method"] == method]
    runs += [r for r in load(f"time_to_target/link-n{n}.json")["results"] if r["method"] == method]
    steps = {r["seed"]: r["reached"]["steps"] for r in runs}
    if n == 2 and method == "adamw_fp32":
        whole = load("time_to_target/target.json")["results"]
        half = whole[0]["steps"] // 2
        goal = -(-statistics.fmean(next(c[3] for c in r["curve"] if c[0] >= half) for r in whole) * 100 // 1) / 100
        steps = {r["seed"]: next(c[0] for c in r["curve"] if c[3] <= goal) for r in whole}
    assert sorted(steps) == [0, 1, 2], f"suite 5, N = {n}, {method}: seeds {sorted(steps)}"
    return statistics.fmean(steps.values()) * s5_link(n, method)


def cnn_accuracy(variant, run="digits_cnn_check.json"):
    """The digits CNN check (lr advice): a variant's mean test accuracy over its seeds, %
    (`run`: digits_cnn_check_b09.json for the check at betas (0.9, 0.9))."""
    return load(run)["variants"][variant]["summary"]["test_accuracy"]["mean"]


# marker -> (what it is, where it comes from, its value)
FIGURES = {
    "s3-n2-vote-ms": ("DistributedLion's step at N = 2, ms", "median of training-n2-run{1,2,3}.json",
                      lambda: 1e3 * statistics.median(n2("distlion_vote"))),
    "s3-n2-fp32-ms": ("Lion + fp32 DDP's step at N = 2, ms", "median of training-n2-run{1,2,3}.json",
                      lambda: 1e3 * statistics.median(n2("lion_fp32"))),
    "s3-n2-floor-ms": ("the no-communication floor at N = 2, ms", "median of training-n2-run{1,2,3}.json",
                       lambda: 1e3 * statistics.median(n2("no_comm"))),
    "s3-n2-fp32-over-vote": ("Lion + fp32 step / DistributedLion step, N = 2", "training-n2-run{1,2,3}.json",
                             lambda: statistics.median(n2_ratio("lion_fp32", "distlion_vote"))),
    "s3-n2-vote-vs-floor": ("DistributedLion step / floor, N = 2", "training-n2-run{1,2,3}.json",
                            lambda: statistics.median(n2_ratio("distlion_vote", "no_comm"))),
    "s3-n2-fp32-vs-floor": ("Lion + fp32 step / floor, N = 2", "training-n2-run{1,2,3}.json",
                            lambda: statistics.median(n2_ratio("lion_fp32", "no_comm"))),
    "s3-n2-l1p4-over-vote": ('"l1" 4-bit step / vote step, N = 2', "training-n2-run{1,2,3}.json",
                             lambda: statistics.median(n2_ratio("distlion_l1p4", "distlion_vote"))),
    "s3-n2-vote-mb": ("DistributedLion's payload per rank and step at N = 2, MB", "training-n2-run{1,2,3}.json",
                      lambda: statistics.median(n2("distlion_vote", "bytes_per_rank")) / 1e6),
    "s3-n2-fp32-mb": ("fp32 DDP's payload per rank and step at N = 2, MB", "training-n2-run{1,2,3}.json",
                      lambda: statistics.median(n2("lion_fp32", "bytes_per_rank")) / 1e6),
    "s3-n4-vote-vs-floor": ("DistributedLion step / floor, N = 4", "training-n4.json",
                            lambda: n4("distlion_vote") / n4("no_comm")),
    "s3-n4-fp32-over-vote": ("Lion + fp32 step / DistributedLion step, N = 4", "training-n4.json",
                             lambda: n4("lion_fp32") / n4("distlion_vote")),
    "s3-n4-fp32-vs-floor": ("Lion + fp32 step / floor, N = 4", "training-n4.json",
                            lambda: n4("lion_fp32") / n4("no_comm")),
    "s1-n4-16m-fp32-over-vote": ("Gloo fp32 / vote, 1 Gbit/s, N = 4, d = 16M", "collectives.json",
                                 lambda: s1_speedup("collectives.json", 4, 1 << 24)),
    "s1-n2-64m-fp32-over-vote": ("Gloo fp32 / vote, 1 Gbit/s, N = 2, d = 64M", "collectives-link.json",
                                 lambda: s1_speedup("collectives-link.json", 2, 1 << 26)),
    "levers-alt-bytes-saving": ('"alternate": % fewer payload bytes than the vote', "training-levers.json",
                                lambda: 100 * (1 - over_vote("distlion_alt"))),
    "levers-l1p4-bytes": ('"l1" 4-bit payload / vote payload', "training-levers.json",
                          lambda: over_vote("distlion_l1p4")),
    "levers-l1p8-bytes": ('"l1" 8-bit payload / vote payload', "training-levers.json",
                          lambda: over_vote("distlion_l1p8")),
    # The wire bytes: the JSON's payload of the momentum-sync rows also counts the bytes received.
    "levers-ms100-bytes-extra": ("momentum_sync=100: % more wire bytes than the vote", "training-levers.json",
                                 lambda: 100 * (over_vote("distlion_ms100", "wire_bytes_per_rank") - 1)),
    "s5-n2-vote-s-step": ("suite 5, N = 2: the vote's s/step on the link", "time_to_target/link-n2.json",
                          lambda: s5_link(2, "distlion_vote")),
    "s5-n2-psgd-s-step": ("suite 5, N = 2: PowerSGD 4's s/step on the link", "time_to_target/link-n2.json",
                          lambda: s5_link(2, "adamw_powersgd4")),
    "s5-n2-fp32-s-step": ("suite 5, N = 2: AdamW + fp32's s/step on the link", "time_to_target/link-n2.json",
                          lambda: s5_link(2, "adamw_fp32")),
    "s5-n2-vote-s": ("suite 5, N = 2: the vote's s to target", "time_to_target/",
                     lambda: s5_seconds(2, "distlion_vote")),
    "s5-n2-alt-s": ("suite 5, N = 2: alternate's s to target", "time_to_target/",
                    lambda: s5_seconds(2, "distlion_alt")),
    "s5-n2-psgd-s": ("suite 5, N = 2: PowerSGD 4's s to target", "time_to_target/",
                     lambda: s5_seconds(2, "adamw_powersgd4")),
    "s5-n2-fp32-s": ("suite 5, N = 2: AdamW + fp32's s to target", "time_to_target/",
                     lambda: s5_seconds(2, "adamw_fp32")),
    "s5-n2-alt-vs-psgd": ("suite 5, N = 2: PowerSGD 4's s to target / alternate's", "time_to_target/",
                          lambda: s5_seconds(2, "adamw_powersgd4") / s5_seconds(2, "distlion_alt")),
    "cnn-vote-acc": ("digits CNN: the advised vote's mean test accuracy, %", "digits_cnn_check.json",
                     lambda: cnn_accuracy("vote")),
    "cnn-lion-acc": ("digits CNN: tuned Lion's mean test accuracy, %", "digits_cnn_check.json",
                     lambda: cnn_accuracy("lion")),
    "cnn-vote-minus-lion": ("digits CNN: vote - Lion, points", "digits_cnn_check.json",
                            lambda: cnn_accuracy("vote") - cnn_accuracy("lion")),
    "cnn-b09-vote-acc": ("digits CNN, betas (0.9, 0.9): the advised vote's mean test accuracy, %",
                         "digits_cnn_check_b09.json", lambda: cnn_accuracy("vote", "digits_cnn_check_b09.json")),
    "cnn-b09-lion-acc": ("digits CNN, betas (0.9, 0.9): Lion's mean test accuracy, %",
                         "digits_cnn_check_b09.json", lambda: cnn_accuracy("lion", "digits_cnn_check_b09.json")),
    "cnn-b09-vote-minus-tuned-lion": ("digits CNN: the vote at (0.9, 0.9) - tuned Lion, points",
                                      "digits_cnn_check*.json",
                                      lambda: cnn_accuracy("vote", "digits_cnn_check_b09.json") - cnn_accuracy("lion")),
    "gpu-only-lines": ("GPU-only code lines", "tools/gpu_only_lines.sh's files", gpu_only_lines),
    "bad-input-rows": ("rows of docs/bad-input.md", "docs/bad-input.md", bad_input_rows),
    "bad-input-cases": ("case_* functions", "tests/python/test_bad_input.py", lambda: bad_input_tests(True)),
    "bad-input-own-tests": ("test functions besides test_case", "tests/python/test_bad_input.py",
                            lambda: bad_input_tests(False)),
}
# Figures whose JSON is a measurement of minutes: ±1 minute is "about".
TOLERANCE = {}


# The times of `make demo`, `make test` and .ci/run on each machine of
# test_durations.json, marked fig:time-<slug>-<what> (slug: the entry's "slug").
TIMES = {
    "make-test-min": ("`make test` on a fresh clone, minutes", "make_test_s", 60, 1.0),
    "ci-run-min": ("a CI run (.ci/run), minutes", "ci_run_s", 60, 1.0),
    "memcheck-min": ("CI's make test-sanitize and make test-valgrind, minutes", "ci_memcheck_s", 60, 1.0),
    "sanitize-python-min": ("CI's make test-sanitize-python, minutes", "ci_sanitize_python_s", 60, 1.0),
    "demo-first-min": ("the first `make demo` on a fresh machine, minutes", "demo_first_run_s", 60, 1.0),
    "demo-warm-s": ("`make demo` once set up, s", "demo_warm_s", 1, 3.0),
    "build-cold-s": ("the extension's cold build, s", "cold_build_s", 1, 5.0),
}


def machine_times():
    """marker key -> (what, source, value) for every time test_durations.json has."""
    out = {}
    for name, entry in load("test_durations.json")["machines"].items():
        for what_key, (what, field, unit, tolerance) in TIMES.items():
            if field in entry:
                key = f"time-{entry['slug']}-{what_key}"
                out[key] = (f"{name}: {what}", f"test_durations.json's {name!r} {field}",
                            lambda v=entry[field], u=unit: v / u)
                TOLERANCE[key] = tolerance
    return out


FIGURES.update(machine_times())


def number(text):
    return float(text.replace(",", ""))


def agrees(written, value, tolerance=None):
    """`written` is `value` rounded to the decimals written (either way at a half)."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    slack = tolerance if tolerance is not None else 0.5 * 10**-decimals + 1e-9
    return abs(number(written) - value) <= slack


def markers():
    """(page, key, the number written after it) for every figure marker of every page."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in MARKER.finditer(text):
            after = re.match(r"[ \t]*(?:\*\*)?[+]?(" + NUMBER + ")", text[m.end():])
            found.append((page, m.group(1), after.group(1) if after else None))
    return found


def test_readme_has_at_most_250_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; at most 250 (move the detail to a page under docs/)"


def test_benchmarks_page_has_at_most_500_lines():
    n = len((DOCS / "benchmarks.md").read_text().splitlines())
    assert n <= 500, f"docs/benchmarks.md has {n} lines; at most 500 (history goes to docs/design-notes.md)"


def test_the_readme_marks_its_headline_figures():
    keys = {key for page, key, _ in markers() if page.name == "README.md"}
    headline = {"s3-n2-vote-ms", "s3-n2-fp32-ms", "s3-n2-floor-ms", "s3-n2-fp32-over-vote", "s3-n2-vote-vs-floor",
                "s3-n2-vote-mb", "s3-n2-fp32-mb", "s3-n2-command", "gpu-only-lines"}
    assert headline <= keys, f"README.md: the figure markers {sorted(headline - keys)} are gone"


def test_every_marked_figure_matches_its_source():
    problems = []
    for page, key, written in markers():
        if key == "s3-n2-command":
            continue  # test_the_headline_command_is_the_one_that_ran
        if key not in FIGURES:
            problems.append(f"{rel(page)}: marker fig:{key} is not in FIGURES of {rel(Path(__file__))}")
            continue
        what, source, value = FIGURES[key]
        if written is None:
            problems.append(f"{rel(page)}: marker fig:{key} ({what}) is not followed by a number")
            continue
        v = value()
        if not agrees(written, v, TOLERANCE.get(key)):
            problems.append(f"{rel(page)}: {what} (fig:{key}) states {written}, {source} gives {v:.4g}")
    assert not problems, "\n".join(problems)


def normalized_command(cmd):
    cmd = re.sub(r"\s+--(json|timeline) \S+", "", cmd.split("#")[0])
    return " ".join(cmd.split())


def test_the_headline_command_is_the_one_that_ran():
    ran = {normalized_command(load(run)["meta"]["command"]) for run in N2_RUNS}
    assert len(ran) == 1, f"the three N = 2 runs ran different commands: {ran}"
    seen = 0
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"<!-- fig:s3-n2-command -->", text):
            line = next((ln for ln in text[m.end():].splitlines() if "bench/training.py" in ln), "")
            stated = normalized_command(line)
            assert stated in ran, (f"{rel(page)}: suite 3's N = 2 command (fig:s3-n2-command) states {stated!r}, "
                                   f"{N2_RUNS[0]} ran {sorted(ran)[0]!r}")
            seen += 1
    assert seen, "no page marks suite 3's N = 2 command (fig:s3-n2-command)"


def test_the_readme_states_each_machines_times():
    """Issue 45: the first run and the test loop, for every machine measured (CPU and ISA named)."""
    keys = {key for page, key, _ in markers() if page.name == "README.md"}
    machines = load("test_durations.json")["machines"]
    assert len(machines) >= 2, "test_durations.json: one entry per machine, both of the project's kinds"
    problems = []
    for name, entry in machines.items():
        assert re.fullmatch(r"(Intel Xeon|AMD EPYC), (AVX-512|AVX2)", name), f"test_durations.json: machine {name!r}"
        for what_key in ("make-test-min", "demo-first-min", "demo-warm-s"):
            key = f"time-{entry['slug']}-{what_key}"
            if key not in keys:
                problems.append(f"README.md does not mark {name}'s {TIMES[what_key][0]} (fig:{key})")
    assert not problems, "\n".join(problems)


def suite3_table():
    """docs/benchmarks.md's table of suite 3 at N = 2 and 4: impl -> its cells."""
    lines = (DOCS / "benchmarks.md").read_text().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("| impl | N = 2 step ms")), None)
    assert start is not None, "docs/benchmarks.md lost suite 3's N = 2 / N = 4 table"
    rows = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        rows[cells[0].split()[0]] = cells
    return rows


def spread(values):
    return [statistics.median(values), min(values), max(values)]


def test_suite3_table_matches_its_json():
    rows = suite3_table()
    assert {"no_comm", "distlion_vote", "distlion_l1p4", "lion_fp32"} <= set(rows), sorted(rows)
    problems = []

    def check(impl, column, cell, values, source):
        if cell.startswith("(") or cell in ("–", "-"):
            return
        written = re.findall(NUMBER, cell)
        if len(written) != len(values):
            problems.append(f"docs/benchmarks.md suite 3, {impl}, {column}: {cell!r} holds {len(written)} numbers, "
                            f"expected {len(values)}")
            return
        for w, v in zip(written, values):
            if not agrees(w, v):
                problems.append(f"docs/benchmarks.md suite 3, {impl}, {column}: states {w}, {source} gives {v:.4g}")

    for impl, cells in rows.items():
        _, step2, ratio2, alone2, step4, ratio4, payload = cells
        check(impl, "N = 2 step ms", step2, [1e3 * v for v in spread(n2(impl))], "training-n2-run{1,2,3}.json")
        if impl != "no_comm":
            check(impl, "N = 2 vs floor", ratio2, spread(n2_ratio(impl, "no_comm")), "training-n2-run{1,2,3}.json")
            check(impl, "N = 2 comm-alone ms", alone2, [1e3 * statistics.median(n2(impl, "comm_alone_s"))],
                  "training-n2-run{1,2,3}.json")
            check(impl, "N = 4 vs floor", ratio4, [n4(impl) / n4("no_comm")], "training-n4.json")
        check(impl, "N = 4 step ms", step4, [1e3 * n4(impl)], "training-n4.json")
        check(impl, "payload MB/rank N = 2 / 4", payload,
              [statistics.median(n2(impl, "bytes_per_rank")) / 1e6, n4(impl, "bytes_per_rank") / 1e6],
              "training-n2-run*.json / training-n4.json")
    assert not problems, "\n".join(problems)


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path):
    seen, out = {}, set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        s = slug(line.lstrip("#"))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path):
    """The relative link targets of a Markdown page, outside code."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_lead_to_existing_files(page):
    problems = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            problems.append(f"{rel(page)}: link {target} leads to no file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel(page)}: link {target}: {dest.name} has no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)
