package process

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// TestPrometheusScrapesShares: Debian's Prometheus scrapes `mgpu-cli
// metrics serve` (both on loopback) while fixed-share 20/30/50 instances
// run. Through Prometheus's HTTP API, each instance's
// rate(mgpu_instance_gpu_seconds_total[10s]) is within 0.02 of the share
// the enforcer measured over the same window (the exporter reports what
// mgpu measured); the memory series equal what the processes hold on the
// device; an instance admitted on the second GPU and never used has its
// quota series already. The rates are also within 0.02 of the quotas
// (0.20 / 0.30 / 0.50) with Prometheus's and the exporter's CPU beside the
// workloads on 2 cores: before the arbiter shed the credit drift at the
// caps (docs/arbiter.md, "Instances that leave the device idle") the 20
// measured 16.3-19.3 % here.
func TestPrometheusScrapesShares(t *testing.T) {
	prom, err := exec.LookPath("prometheus")
	if err != nil {
		t.Skip("prometheus is not installed (scripts/deps.sh installs Debian's)")
	}
	n := newNode(t, harness.NodeConfig{Devices: 2, Policies: map[int]policy.Policy{0: policy.FixedShare, 1: policy.FixedShare}})
	// Prometheus and the exporter first: Prometheus's start (its storage,
	// its first scrapes) takes CPU that the workloads would miss on a
	// 2-core machine, which would move their shares, not the metrics.
	exporter := startExporter(t, n)
	api := startPrometheus(t, prom, exporter)
	if err := harness.WaitFor(30*time.Second, func() error {
		_, err := promQuery(api, "mgpu_device_up", time.Time{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	cores := []int{20, 30, 50}
	pids := make([]map[int]bool, len(cores))
	names := make([]string, len(cores))
	var procs []harness.Proc
	for i, c := range cores {
		sh, err := n.Shell(0, c, 1024)
		if err != nil {
			t.Fatal(err)
		}
		names[i] = sh.Instance.Name
		p, err := sh.Spawn("compute", "--seconds", "120", "--api", "launch", "--kernel-us", "1000", "--depth", "4")
		if err != nil {
			t.Fatal(err)
		}
		pids[i] = map[int]bool{p.PID: true}
		procs = append(procs, p)
		if c == 30 { // and memory: 256 MiB held until killed
			a, err := sh.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "256", "--hold-ms", "-1")
			if err != nil {
				t.Fatal(err)
			}
			if err := a.WaitOutput("holding", 15*time.Second); err != nil {
				t.Fatal(err)
			}
			pids[i][a.PID] = true
		}
	}
	idle, err := n.Shell(1, 10, 512)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		if err := p.WaitOutput("start", 15*time.Second); err != nil {
			t.Fatal(err)
		}
	}

	// Let the shares settle, then read the device over the window that
	// Prometheus's rate covers.
	time.Sleep(3 * time.Second) // settling, not synchronisation
	s0, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	m0 := instanceGPU(t, n)
	time.Sleep(10 * time.Second) // the measurement window
	s1, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	m1 := instanceGPU(t, n)
	// Prometheus has scraped past s1 once its newest sample is after it.
	if err := harness.WaitFor(10*time.Second, func() error {
		r, err := promQuery(api, "timestamp(mgpu_device_up)", time.Time{})
		if err != nil {
			return err
		}
		if len(r) == 0 || time.Unix(0, int64(r[0].value*1e9)).Before(s1.At) {
			return fmt.Errorf("no scrape after the window yet")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	win := s1.At.Sub(s0.At).Round(time.Second)
	rates, err := promQuery(api, fmt.Sprintf("rate(mgpu_instance_gpu_seconds_total{device=\"0\"}[%ds])", int(win.Seconds())), s1.At)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]float64{}
	for _, r := range rates {
		byName[r.labels["mgpu_instance"]] = r.value
	}
	for i, c := range cores {
		got, ok := byName[names[i]]
		if !ok {
			t.Fatalf("no rate for %s in %+v", names[i], rates)
		}
		dev := harness.Share(s0, s1, 0, pids[i]) / 100
		measured := float64(m1[names[i]]-m0[names[i]]) / float64(s1.At.Sub(s0.At))
		t.Logf("%s (core %d): Prometheus rate %.4f, measured by mgpu %.4f, simulated device %.4f", names[i], c, got, measured, dev)
		if math.Abs(got-measured) > 0.02 {
			t.Errorf("%s: rate %.4f, mgpu measured %.4f over the same window", names[i], got, measured)
		}
		if q := float64(c) / 100; math.Abs(got-q) > 0.02 {
			t.Errorf("%s: rate %.4f, want the quota %.2f ± 0.02", names[i], got, q)
		}
	}

	// Memory: what the processes hold on the device.
	mem, err := promQuery(api, "mgpu_instance_memory_used_bytes", time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	d, _ := s1.State.Device(0)
	for _, r := range mem {
		i := indexOf(names, r.labels["mgpu_instance"])
		if i < 0 {
			continue
		}
		var held uint64
		for _, p := range d.Procs {
			if pids[i][p.PID] {
				held += p.MemUsed
			}
		}
		if r.value != float64(held) {
			t.Errorf("%s: mgpu_instance_memory_used_bytes %.0f, the device holds %d for it", names[i], r.value, held)
		}
		if cores[i] == 30 && held < 256<<20 {
			t.Errorf("the 30 holds %d bytes, want at least its 256 MiB allocation", held)
		}
	}

	// The idle instance's quota series, before its first use.
	for q, want := range map[string]float64{
		"mgpu_instance_compute_quota_ratio": 0.1,
		"mgpu_instance_memory_quota_bytes":  512 << 20,
		"mgpu_instance_gpu_seconds_total":   0,
	} {
		r, err := promQuery(api, fmt.Sprintf("%s{mgpu_instance=%q}", q, idle.Instance.Name), time.Time{})
		if err != nil {
			t.Fatal(err)
		}
		if len(r) != 1 || r[0].value != want {
			t.Errorf("%s of the idle instance %s: %+v, want one series of %v", q, idle.Instance.Name, r, want)
		}
	}
}

// instanceGPU is each instance's measured GPU time (ns) on device 0, from
// its enforcer.
func instanceGPU(t *testing.T, n *harness.Node) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, s := range stats0(t, n) {
		out[s.Name] = s.GPUNs
	}
	return out
}

func indexOf(list []string, s string) int {
	for i, x := range list {
		if x == s {
			return i
		}
	}
	return -1
}

// startExporter runs `mgpu-cli metrics serve` on a free loopback port and
// returns its address.
func startExporter(t *testing.T, n *harness.Node) string {
	t.Helper()
	addr, cmd, err := n.StartMetrics()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	return addr
}

// startPrometheus runs prometheus on loopback, scraping target every
// second, and returns its base URL.
func startPrometheus(t *testing.T, bin, target string) string {
	t.Helper()
	dir := t.TempDir()
	cfg := fmt.Sprintf("global:\n  scrape_interval: 2s\n  scrape_timeout: 1500ms\nscrape_configs:\n  - job_name: mgpu\n    static_configs:\n      - targets: [%q]\n", target)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	cmd := exec.Command(bin, "--config.file="+filepath.Join(dir, "prometheus.yml"), //nolint:gosec // Debian's prometheus
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address=127.0.0.1:"+strconv.Itoa(port))
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = log.Close()
		if t.Failed() {
			if b, err := os.ReadFile(log.Name()); err == nil {
				t.Logf("prometheus log:\n%s", b)
			}
		}
	})
	base := "http://127.0.0.1:" + strconv.Itoa(port)
	if err := harness.WaitFor(30*time.Second, func() error {
		resp, err := http.Get(base + "/-/ready") //nolint:gosec,noctx // loopback, the test's own server
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("not ready: %s", resp.Status)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return base
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

type promSample struct {
	labels map[string]string
	at     time.Time
	value  float64
}

// promQuery runs an instant query (at the zero time: now); an empty result
// is an error.
func promQuery(base, q string, at time.Time) ([]promSample, error) {
	v := url.Values{"query": {q}}
	if !at.IsZero() {
		v.Set("time", strconv.FormatFloat(float64(at.UnixNano())/1e9, 'f', 3, 64))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/v1/query?"+v.Encode(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Value  [2]any            `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("%s: %w: %s", q, err, body)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("%s: %s", q, r.Error)
	}
	if len(r.Data.Result) == 0 {
		return nil, fmt.Errorf("%s: no result yet", q)
	}
	out := make([]promSample, 0, len(r.Data.Result))
	for _, s := range r.Data.Result {
		ts, _ := s.Value[0].(float64)
		str, _ := s.Value[1].(string)
		val, err := strconv.ParseFloat(str, 64)
		if err != nil {
			return nil, fmt.Errorf("%s: value %v", q, s.Value)
		}
		out = append(out, promSample{labels: s.Metric, at: time.Unix(0, int64(ts*1e9)), value: val})
	}
	return out, nil
}
