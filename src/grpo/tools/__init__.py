"""The commands people type: ``grpo check``, ``grpo ask``, ``grpo doctor`` and the project's own tools.

    cli.py                   the ``grpo`` command (no torch: parses, resolves the params, refuses bad ones)
    check_report.py          ``grpo check``'s report and ``grpo doctor --params``' stage needs (the half with torch)
    memory.py, measured.yaml one step's memory estimate and the measured figures ``grpo check`` prints
    timing.py, measured_times.yaml   each stage's modelled time on a card
    ask.py                   one question answered by base + adapter
    dvcstatus.py             the stages ``dvc repro`` would run, in one line each
    synthetic.py             a synthetic model of a known architecture (memory traces without the hub)
    code_deps.py             the stages' code deps in dvc.yaml from the import graph; the layers' check

No stage imports this package. May import: every package.
"""
