"""The control loop of one fit: windows to decisions to loader switches, under the job's budget."""
