"""The params: params.yaml read, validated and overlaid, one section per stage.

    reading.py               the sections' base (Section), load_sections(), reading params.yaml
    sections/                one module per params.yaml section, the one home of its keys and defaults
    params.py                every section together (AllParams), equal to params.yaml key for key
    overlay.py               overlay_params(): presets and --set over params.yaml
    choices.py               every registry by the param it serves: a choice's values are its
                             registry's names, an entry's options its own model

It sits above the components so that a choice is checked against the registries below it (by name,
``importlib``: a stage depends on what it runs, not on every entry it could choose). May import:
grpo.core, grpo.algorithm, grpo.data, grpo.model, grpo.rollout.
"""
