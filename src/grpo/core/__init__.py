"""The ground floor: what every other package uses and nothing of the project's own that it needs.

    errors.py, messages.py   the error types; the wording of a bad param (a failure path's only)
    registry.py, fields.py   the registries of named choices; the typed-options base of sections and entries
    types.py                 the records passed between the step's phases, tensor shapes on every field
    jsonio.py, console.py    validated JSON/JSONL reads and atomic writes; the log a person reads
    device.py                device, dtype and attention policy
    architectures.py, model_shapes.py   the known architectures; a model's shapes from its config.json
    distributed.py           the process group from the launcher's environment and the few collectives
    dvcfile.py               dvc.yaml read as data (its stages, their commands and outputs)

May import: nothing of grpo outside this package.
"""
