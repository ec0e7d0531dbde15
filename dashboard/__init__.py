"""ClusterPulse dashboard (Streamlit) and the operator actions behind it."""
