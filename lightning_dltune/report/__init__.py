"""What users read: reasons in words, the console table, logged metrics, the TensorBoard layout, the recommendation."""
