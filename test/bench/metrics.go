package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// metricsCost: what `mgpu-cli metrics serve` costs with 16 busy instances.
// Interleaved rounds of equal length, without scrapes and with scrapes back
// to back, measure the CPU of the exporter and the enforcer together (from
// /proc/<pid>/stat); the difference per scrape, at one scrape every 15 s,
// is the exporter's cost in percent of a core. The scrape's wall time is
// reported too: the enforcer builds each answer under its lock and writes
// it after, so that time is not spent holding the arbitration loop.
func (b *bench) metricsCost() error {
	n, err := harness.NewNode(harness.NodeConfig{MaxInstances: 16})
	if err != nil {
		return err
	}
	defer func() { _ = n.Close() }()
	if err := n.StartEnforcer(0); err != nil {
		return err
	}
	jobs, err := startBusy16(n, 600)
	defer func() {
		for _, j := range jobs {
			j.Kill()
		}
	}()
	if err != nil {
		return err
	}
	addr, exp, err := n.StartMetrics()
	if err != nil {
		return err
	}
	defer func() { _ = exp.Process.Kill(); _ = exp.Wait() }()
	url := "http://" + addr + "/metrics"
	scrape := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		req.Header.Set("Accept", "application/openmetrics-text;version=1.0.0")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer func() { _ = resp.Body.Close() }()
		body, err := io.ReadAll(resp.Body)
		if err == nil && !strings.Contains(string(body), "mgpu_instance_gpu_seconds_total") {
			err = fmt.Errorf("%s: no instance series in the answer", url)
		}
		return err
	}
	if err := scrape(); err != nil {
		return err
	}
	pids := []int{n.EnforcerPID(0), exp.Process.Pid}
	cpu := func() (float64, error) { // CPU seconds of the two processes
		var t float64
		for _, p := range pids {
			s, err := cpuSeconds(p)
			if err != nil {
				return 0, err
			}
			t += s
		}
		return t, nil
	}
	const round = 3 * time.Second
	var off, on, scrapes, wall float64
	for r := 0; r < b.rounds; r++ {
		c0, err := cpu()
		if err != nil {
			return err
		}
		time.Sleep(round) // the round without scrapes
		c1, err := cpu()
		if err != nil {
			return err
		}
		off += c1 - c0
		start := time.Now()
		k := 0
		for time.Since(start) < round {
			if err := scrape(); err != nil {
				return err
			}
			k++
		}
		d := time.Since(start)
		c2, err := cpu()
		if err != nil {
			return err
		}
		// the round with scrapes, scaled to the round's length
		on += (c2 - c1) * round.Seconds() / d.Seconds()
		scrapes += float64(k) * round.Seconds() / d.Seconds()
		wall += d.Seconds() / float64(k)
	}
	perScrape := (on - off) / scrapes
	b.report("metrics_scrape_cpu", 1000*perScrape, "ms/scrape", info(""))
	b.report("metrics_scrape_wall", 1000*wall/float64(b.rounds), "ms/scrape", info(""))
	b.report("metrics_cpu_at_15s_scrapes", 100*perScrape/15, "% of a core", atMost(0.5, "(16 instances)"))
	return nil
}
