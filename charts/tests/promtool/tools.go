//go:build tools

// Package promtool pins the Prometheus release whose promtool the chart tests use to check and
// unit-test the chart's alerting rules and the dashboard's queries (see build.sh).
package promtool

import _ "github.com/prometheus/prometheus/cmd/promtool"
