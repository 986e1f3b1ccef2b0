"""The commands the docs tell people to run that start vLLM engines or GPU checks: greedy comparisons
(``compare``), one-engine evaluations (``evaluate``), calibration measurements (``calibrate``,
``costs``), continuations for the replay proposer (``replay_record``) and the demo (``demo``)."""
