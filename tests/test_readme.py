"""What README.md claims stays tied to what was measured and to what the CLI does."""

from __future__ import annotations

import re
from pathlib import Path

from ncclwatch import cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_inspector_measurement_names_the_inspector_it_measured():
    # a bullet or paragraph with a capture or overhead number about Inspector must say
    # which Inspector (an NCCL release or commit) it is about
    blocks = re.split(r"\n(?=- )|\n\n", README)
    measured = [b for b in blocks if "Inspector" in b and re.search(r"\d+ ?%", b)]
    assert measured
    for block in measured:
        assert re.search(r"NCCL v?2\.\d+\.\d+|commit `[0-9a-f]{7,}`|same machine and Inspector build", block), block


def test_readme_does_not_claim_inspector_lacks_p2p_or_dumps_only_every_30_s():
    lowered = README.lower()
    for claim in ("no send/recv at all", "dumps at most every 30 s", "keeps only means"):
        assert claim not in lowered, claim
    assert "NCCL_INSPECTOR_ENABLE_P2P" in README


def test_readme_exit_codes_are_the_clis():
    documented = dict(re.findall(r"(?m)^\| (\d+) \| (.+) \|$", README))
    in_help = dict(re.findall(r"(?m)^  (\d+) +(.+)$", cli.EXIT_CODES))
    assert documented.keys() == in_help.keys()
