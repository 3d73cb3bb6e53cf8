"""scripts/gpu-check's body (issue 29): plan.py says what runs, execute.py runs a part within its
budget, report.py writes the report; __main__.py is the command."""
