package cli

import (
	"strings"
	"testing"
)

// Without running enforcers every device reads mgpu_device_up 0 and
// nothing else; the command still succeeds (a scrape must not fail).
func TestMetricsDumpEnforcersDown(t *testing.T) {
	out, stderr, code := run(t, "--config", simNode, "metrics", "dump")
	if code != 0 {
		t.Fatalf("status %d: %s", code, stderr)
	}
	var series []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if !strings.HasPrefix(l, "#") {
			series = append(series, l)
		}
	}
	if len(series) != 2 || !strings.HasPrefix(series[0], `mgpu_device_up{device="0",`) || !strings.HasSuffix(series[0], "} 0") ||
		!strings.HasPrefix(series[1], `mgpu_device_up{device="1",`) || !strings.HasSuffix(series[1], "} 0") {
		t.Errorf("series %q, want mgpu_device_up 0 for devices 0 and 1", series)
	}
}

func TestMetricsServeBadListen(t *testing.T) {
	for _, addr := range []string{"nope", "127.0.0.1:70000", "example.com:9407"} {
		_, stderr, code := run(t, "--config", simNode, "metrics", "serve", "--listen", addr)
		if code != 2 || !strings.HasPrefix(stderr, "mgpu: --listen ") || strings.Count(stderr, "\n") != 1 {
			t.Errorf("--listen %s: status %d, stderr %q; want 2 and one line", addr, code, stderr)
		}
	}
	_, stderr, code := run(t, "--config", simNode, "metrics", "dump", "extra")
	if code != 2 || !strings.Contains(stderr, "takes no arguments") {
		t.Errorf("dump extra: status %d, %q", code, stderr)
	}
}
