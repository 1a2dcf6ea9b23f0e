"""`exlcli bench`: prefill/decode throughput, a serving workload, and chat beside a batch job."""
