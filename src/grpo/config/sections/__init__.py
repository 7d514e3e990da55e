"""One module per ``params.yaml`` section (``grpo.config.params`` gathers them all). A stage imports the
sections it reads and no other, so an edit of one section's schema re-runs only the stages that
read it (tests/test_dvc_graph.py)."""
