"""``dcp-safe bench``'s quick pass and its regression guard.

The quick pass runs for real (real DCP saves to disk, real loads) at a tiny size; the tests
check what it records, never how fast anything was. The comparator is a pure function and is
fed synthetic results.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from dcp_safe.bench.compare import compare_ratios, make_ratio, unmatched
from dcp_safe.bench.quick import SCHEMA, main
from dcp_safe.errors import ConfigError

EXPECTED_RATIOS = {
    "stall_vs_torch_default_async",
    "stall_vs_copy_floor",
    "local_commit_vs_filesystemwriter",
    "raw_floor_vs_local_commit",
    "load_vs_filesystemreader",
    "peak_rss_over_generation",
    "pair_peak_rss_over_generation",
}


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    work = tmp_path_factory.mktemp("bench")
    out = work / "quick.json"
    code = main(["--size-mib", "4", "--rounds", "2", "--dir", str(work), "--json", str(out)])
    assert code == 0
    return json.loads(out.read_text()), work


def test_quick_pass_records_every_ratio_positive_and_finite(
    quick_result: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick_result
    assert result["schema"] == SCHEMA
    assert set(result["ratios"]) == EXPECTED_RATIOS
    for name, entry in result["ratios"].items():
        assert entry["better"] in ("lower", "higher"), name
        assert math.isfinite(entry["value"]) and entry["value"] > 0, (name, entry)
        assert entry["description"], name


def test_quick_pass_records_its_rounds_orders_and_machine(
    quick_result: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick_result
    assert result["rounds"] == 2 and len(result["per_round"]) == 2
    assert result["orders"][0] != result["orders"][1]  # the order rotates
    assert result["payload_bytes"] >= 4 << 20
    assert result["machine"]["logical_cpus"] >= 1
    assert result["command"].startswith("dcp-safe bench --size-mib 4")
    for contender in ("dcp_safe", "torch_default_async"):
        session = result["per_round"][0][contender]
        assert len(session["saves"]) == 2
        for save in session["saves"]:
            assert 0 < save["stall_s"] <= save["local_commit_s"]
        assert session["pair"]["second_stall_s"] > 0


def test_quick_pass_leaves_no_checkpoint_behind(quick_result: tuple[dict[str, Any], Path]) -> None:
    _, work = quick_result
    assert sorted(p.name for p in work.iterdir()) == ["quick.json"]


def test_quick_pass_compared_with_its_own_json_passes(
    quick_result: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick_result
    assert compare_ratios(result, copy.deepcopy(result), 0.25) == []


def _result(**ratios: tuple[float, str]) -> dict[str, Any]:
    return {"ratios": {n: make_ratio(v, b, n) for n, (v, b) in ratios.items()}}  # type: ignore[arg-type]


def test_compare_flags_a_lower_is_better_ratio_that_grew_beyond_tolerance() -> None:
    before = _result(stall=(0.40, "lower"), save=(1.00, "lower"))
    after = _result(stall=(0.60, "lower"), save=(1.20, "lower"))
    found = compare_ratios(before, after, 0.25)
    assert [r.name for r in found] == ["stall"]
    assert found[0].worsening == pytest.approx(0.5)
    assert "0.400 -> 0.600" in found[0].message(0.25)


def test_compare_flags_a_higher_is_better_ratio_that_fell_beyond_tolerance() -> None:
    before = _result(durable=(0.90, "higher"))
    assert compare_ratios(before, _result(durable=(0.60, "higher")), 0.25)[0].name == "durable"
    assert compare_ratios(before, _result(durable=(0.80, "higher")), 0.25) == []


def test_compare_passes_improvements_and_identical_ratios() -> None:
    before = _result(stall=(0.40, "lower"), durable=(0.90, "higher"))
    assert compare_ratios(before, before, 0.0) == []
    better = _result(stall=(0.10, "lower"), durable=(1.50, "higher"))
    assert compare_ratios(before, better, 0.0) == []


def test_compare_flags_a_ratio_that_became_infinite() -> None:
    before = _result(stall=(0.40, "lower"))
    assert compare_ratios(before, _result(stall=(math.inf, "lower")), 10.0)[0].name == "stall"


def test_compare_reports_ratios_present_in_one_run_only_without_flagging_them() -> None:
    before = _result(old=(1.0, "lower"), both=(1.0, "lower"))
    after = _result(new=(9.0, "lower"), both=(1.0, "lower"))
    assert compare_ratios(before, after, 0.25) == []
    assert unmatched(before, after) == ["new (new)", "old (gone)"]


def test_compare_refuses_a_negative_tolerance_and_a_result_without_ratios() -> None:
    ok = _result(stall=(1.0, "lower"))
    with pytest.raises(ConfigError, match="tolerance"):
        compare_ratios(ok, ok, -0.1)
    with pytest.raises(ConfigError, match="ratios"):
        compare_ratios({"medians": {}}, ok, 0.25)
    with pytest.raises(ConfigError, match="better"):
        compare_ratios({"ratios": {"stall": {"value": 1.0, "better": "up"}}}, ok, 0.25)


def test_main_exits_1_and_names_the_ratio_when_compare_finds_a_regression(
    quick_result: tuple[dict[str, Any], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    result, _ = quick_result
    # A previous run that was far better on one ratio: the new run must read as a regression.
    previous = copy.deepcopy(result)
    previous["ratios"]["stall_vs_copy_floor"]["value"] = (
        result["ratios"]["stall_vs_copy_floor"]["value"] / 1e6
    )
    path = tmp_path / "previous.json"
    path.write_text(json.dumps(previous))
    code = main(
        ["--size-mib", "1", "--rounds", "1", "--dir", str(tmp_path), "--compare", str(path)]
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "REGRESSION stall_vs_copy_floor" in out


def test_main_refuses_a_missing_compare_file(tmp_path: Path) -> None:
    assert main(["--compare", str(tmp_path / "absent.json")]) == 2


@pytest.mark.parametrize("size_mib", ["inf", "1e30"])
def test_a_size_no_host_can_hold_is_a_usage_error(
    size_mib: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was an ``OverflowError`` traceback (inf) or an allocation abort (1e30)."""
    assert main(["--size-mib", size_mib, "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "dcp-safe bench: --size-mib is more than this host's free memory"
