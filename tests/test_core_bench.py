"""The benchmark runs end to end and reports what it promises (on the tiny model)."""
import json

from meta import bench


def test_bench_prints_one_json_line_with_required_keys(capsys):
    bench.main(["--model", "GRAM-Test-Tiny", "--way", "3", "--warmup", "0", "--repeats", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    for key in ("second_order_s", "first_order_s", "plain_step_s", "ratio_second_to_plain", "peak_rss_mb",
                "frozen_bytes_cloned_per_task", "truncation_speedup", "settings"):
        assert key in result, key
    assert result["frozen_bytes_cloned_per_task"] == 0
    assert result["theta_phi_bytes_cloned_per_task"] > 0
    assert result["settings"]["way"] == 3 and result["settings"]["model"] == "GRAM-Test-Tiny"
    assert result["ratio_second_to_plain"] > 0
