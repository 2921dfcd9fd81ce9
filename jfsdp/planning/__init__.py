"""The planner's machinery: will a plan fit, and what does its compiled step do?

memory (the API: estimate beside the compiled measurement, communication per step), estimate,
activations and sizes (the analytic side; tensor_memory and tensor_comm at T > 1), hlo and hlo_text (reading the compiled HLO: collectives,
their loops and overlap), targets (compile-only GPU targets), report (`python -m jfsdp.plan`'s report)."""
