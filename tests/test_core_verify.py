"""Verification and sampling in process: the dataset field, sample identities, the check in a
real local sandbox, and the statistics against hand counts."""
from __future__ import annotations

import asyncio
import json
from math import comb

import pytest

from tests.conftest import ROOT, write_jsonl
from trajgen import dataset, merge, plan, run, verify
from trajgen.distributions import get_distribution, sample_toolsets
from trajgen.options import RunOptions
from trajgen.sandbox.backends import SandboxConfig, bwrap_problem, cleanup, open_sandbox
from trajgen.verify import Verdict


def test_verify_is_validated_and_keys_change_only_for_rows_that_have_it(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "a"}, {"prompt": "a", "verify": "true"}, {"prompt": "b", "verify": 3}, {"prompt": "c", "verify": " "},
    ])
    check = dataset.check(str(path))
    assert check.errors == [f"{path}:3: field 'verify' must be a non-empty string",
                            f"{path}:4: field 'verify' must be a non-empty string"]
    plain, checked = dataset.entries(str(path), check.duplicates)
    # a dataset without verify keeps the key it always had (resume of old runs)
    assert plain.key == dataset.content_hash(dataset.Entry(0, "a", None, None, {})).hex() + "-0"
    assert checked.key != plain.key and checked.verify == "true" and "verify" not in checked.extra


def test_samples_have_their_own_keys_and_share_the_prompts_toolsets(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "verify": "true"} for i in range(20)])
    check = dataset.check(str(path))
    distribution = get_distribution("balanced")

    def run(done=frozenset(), per_sample=False):
        entries = dataset.entries(str(path), check.duplicates)
        return list(plan.tasks(entries, fingerprint=check.fingerprint, done=set(done), distribution=distribution,
                               seed=7, batch_size=10, first_batch=0, unavailable={}, journal={}, samples=3,
                               toolsets_per_sample=per_sample))

    tasks = run()
    prompt_keys = [e.key for e in dataset.entries(str(path), check.duplicates)]
    assert [t.key for t in tasks[:3]] == [prompt_keys[0], f"{prompt_keys[0]}~1", f"{prompt_keys[0]}~2"]
    assert [(t.group_id, t.sample_index) for t in tasks[:3]] == [(prompt_keys[0], i) for i in range(3)]
    assert [t.batch_num for t in tasks] == [n // 10 for n in range(60)]
    for group in (tasks[i:i + 3] for i in range(0, 60, 3)):
        assert group[0].toolsets_sampled == group[1].toolsets_sampled == group[2].toolsets_sampled
    per_sample = run(per_sample=True)
    assert [t.toolsets_sampled for t in per_sample] == [sample_toolsets(distribution, 7, t.key) for t in per_sample]
    assert any(a.toolsets_sampled != b.toolsets_sampled for a, b in zip(tasks, per_sample))
    # resume: landed samples are skipped one by one
    left = run(done={t.key for t in tasks[:4]})
    assert [t.key for t in left] == [t.key for t in tasks[4:]]


@pytest.fixture
def sandbox_config(tmp_path):
    if bwrap_problem():
        pytest.skip(f"bubblewrap cannot run here: {bwrap_problem()}")
    config = SandboxConfig(root_dir=str(tmp_path / "sb"))
    yield config
    cleanup(config)


def in_sandbox(config: SandboxConfig, key: str, steps):
    """Run `steps(check)` in one event loop against one real sandbox; `check` runs a verify command."""
    async def main():
        box = open_sandbox(config, key)

        async def get():
            return box

        async def check(command: str, answer: str = "42", timeout: float = 30) -> verify.Check:
            return await verify.run(command, answer, get, timeout)
        try:
            return await steps(box, check)
        finally:
            await box.close()
    return asyncio.run(main())


def test_verdicts_in_a_real_sandbox(sandbox_config):
    async def steps(box, check):
        passed = await check('test "$(cat .trajgen/final_answer.txt)" = 42 && echo ok')
        assert (passed.verdict, passed.exit_code, passed.output) == (Verdict.PASSED, 0, "ok\n")
        failed = await check("grep -q 41 .trajgen/final_answer.txt")
        assert (failed.verdict, failed.exit_code) == (Verdict.FAILED, 1)
        missing = await check("no-such-checker --all")
        assert (missing.verdict, missing.exit_code, missing.error) == (Verdict.ERROR, 127, "command_not_found")
        slow = await check("echo started; sleep 30", timeout=1)
        assert (slow.verdict, slow.exit_code, slow.output) == (Verdict.TIMEOUT, None, "started\n") and slow.seconds >= 1
        long = await check("seq 1 100000; exit 3")
        assert long.verdict is Verdict.FAILED and len(long.output) == verify.OUTPUT_TAIL
        assert long.output.endswith("100000\n")
    in_sandbox(sandbox_config, "v1", steps)


def test_a_check_that_cannot_take_the_answer_is_an_error_not_a_crash(sandbox_config):
    async def steps(box, check):
        await check("rm -r .trajgen && echo 'not a directory' > .trajgen")  # what a hostile model can leave
        broken = await check("true")
        assert (broken.verdict, broken.error) == (Verdict.ERROR, "sandbox") and ".trajgen" in broken.output
    in_sandbox(sandbox_config, "v2", steps)


def _row(group: str, verdict: str, index: int) -> dict:
    check = {"status": verdict, "error": "command_not_found" if verdict == "error" else None}
    return {"metadata": {"group_id": group, "prompt_key": f"{group}~{index}"}, "verify": check}


def test_pass_rates_and_pass_at_k_match_a_hand_count():
    v = merge.Verification()
    for group, verdicts in {"a": ["passed", "failed", "failed", "timeout"], "b": ["passed", "passed"],
                            "c": ["failed", "error", "error"], "d": ["unverified"]}.items():
        for i, verdict in enumerate(verdicts):
            v.add(_row(group, verdict, i) if verdict != "unverified" else {"metadata": {"group_id": group}})
    stats = v.statistics()
    assert stats["samples"] == {"passed": 3, "failed": 3, "error": 2, "timeout": 1, "unverified": 1}
    assert (stats["errors_by_kind"], stats["timeouts"]) == ({"command_not_found": 2}, 1)
    # judged: a 4 (1 passed), b 2 (2), c 1 (0); errors and unverified rows judge nothing
    assert (stats["samples_judged"], stats["pass_rate_samples"]) == (7, round(3 / 7, 4))
    assert (stats["prompts_judged"], stats["prompts_passed"], stats["pass_rate_prompts"]) == (3, 2, round(2 / 3, 4))
    a2 = 1 - comb(3, 2) / comb(4, 2)  # 0.5
    assert stats["pass_at_k"] == {"1": round((1 / 4 + 1 + 0) / 3, 4), "2": round((a2 + 1) / 2, 4), "3": 0.75, "4": 1.0}
    assert stats["pass_at_k_prompts"] == {"1": 3, "2": 2, "3": 1, "4": 1}
    assert merge.pass_at_k(5, 0, 3) == 0.0 and merge.pass_at_k(5, 3, 3) == 1.0


SOLUTIONS = {  # docs/verification.md's worked example (data/verify_example.jsonl): what a model that solves it leaves
    "v-fizz": ({"fizz.py": "def fizzbuzz(n):\n    return ('FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 "
                           "else 'Buzz' if n % 5 == 0 else str(n))\n"}, "done"),
    "v-palindrome": ({
        "palindrome.py": "def longest_palindrome(s):\n    best = ''\n    for i in range(len(s)):\n"
                         "        for j in (i, i + 1):\n            lo, hi = i, j\n"
                         "            while lo >= 0 and hi < len(s) and s[lo] == s[hi]:\n"
                         "                lo, hi = lo - 1, hi + 1\n"
                         "            if hi - lo - 1 > len(best):\n                best = s[lo + 1:hi]\n    return best\n",
        "test_palindrome.py": "import unittest\nfrom palindrome import longest_palindrome\n\n\n"
                              "class Test(unittest.TestCase):\n    def test_even(self):\n"
                              "        self.assertEqual(longest_palindrome('xabba'), 'abba')\n"}, "done"),
    "v-fib": ({}, "832040"),
}


def test_the_readme_example_passes_a_solution_and_fails_without_one(sandbox_config):
    rows = [json.loads(line) for line in (ROOT / "data" / "verify_example.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(SOLUTIONS)
    for row in rows:
        files, final = SOLUTIONS[row["id"]]

        async def unsolved(box, check):
            return await check(row["verify"], "I could not do it", 60)

        async def solved(box, check):
            for path, text in files.items():
                await box.write_file(path, text.encode())
            return await check(row["verify"], final, 60)
        assert in_sandbox(sandbox_config, f"{row['id']}-solved", solved).verdict is Verdict.PASSED, row["id"]
        failed = in_sandbox(sandbox_config, f"{row['id']}-unsolved", unsolved)
        assert (failed.verdict, failed.error) == (Verdict.FAILED, None), row["id"]


def test_prepare_reads_the_dataset_once_and_the_run_gives_the_keys_it_counted(tmp_path, monkeypatch):
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a"}, {"prompt": "c", "image": "img"}, {"prompt": "a"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    reads = []
    lines = dataset._lines
    monkeypatch.setattr(dataset, "_lines", lambda p: reads.append(p) or lines(p))
    prepared = run.prepare(RunOptions(dataset_file=str(path), run_name="r", output_dir=str(tmp_path / "data"),
                                      base_url="http://127.0.0.1:1/v1", api_key="k", distribution="terminal_only"))
    assert reads == [str(path)]
    assert (prepared.plan.remaining, prepared.plan.rows_with_image, prepared.check.valid) == (5, 1, 5)
    keys = [t.key for t in prepared.tasks()]
    assert len(reads) == 2 and len(set(keys)) == 5
    assert [k.rsplit("-", 1)[1] for k in keys] == ["0", "0", "1", "0", "2"]  # the copies of "a" numbered in order
    assert prepared.manifest["dataset"]["fingerprint"] == dataset.check(str(path)).fingerprint
