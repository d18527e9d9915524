// Package grafana holds mgpu's Grafana dashboard (mgpu-dashboard.json) and
// the test that keeps it importable and in step with the metrics
// `mgpu-cli metrics serve` exports (docs/metrics.md): every query names
// exported metrics and their labels, and every metric has a panel.
package grafana
