"""L1 session hooks: keep docs/support_matrix.md true to what the tests verified."""

import os
from pathlib import Path

from megatron_cp_ext.testing import coverage

PAGE = Path(__file__).resolve().parents[2] / "docs" / "support_matrix.md"


def pytest_sessionfinish(session, exitstatus):
    observed = coverage.seen()
    if not observed:
        return
    if os.environ.get("MCX_WRITE_SUPPORT_MATRIX") == "1":
        PAGE.write_text(coverage.render(observed))
        return
    opt = session.config.option
    targets = [Path(a.split("::")[0]).resolve() for a in session.config.args if "::" not in a]
    whole_l1 = len(targets) == len(session.config.args) and any(
        Path(__file__).parent.is_relative_to(t) for t in targets
    )
    full_run = exitstatus == 0 and whole_l1 and not (opt.keyword or opt.markexpr or getattr(opt, "deselect", None))
    if full_run and PAGE.exists():
        claimed = coverage.parse(PAGE.read_text())
        unverified = sorted(claimed - observed)
        if unverified:
            print(f"\ndocs/support_matrix.md claims cells no test verified: {unverified[:8]}")
            session.exitstatus = 1
