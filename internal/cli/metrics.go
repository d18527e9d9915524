package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/expfmt"
	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/metrics"
)

// metricsRegistry is a registry of the node's devices' metrics.
func metricsRegistry(c *cli.Context) (*config.Config, *prometheus.Registry, error) {
	cfg, devs, err := openDevices(c)
	if err != nil {
		return nil, nil, err
	}
	targets := make([]metrics.Target, 0, len(devs))
	for _, d := range devs {
		targets = append(targets, metrics.Target{Index: d.Index, UUID: d.UUID, Source: controlClient(cfg, d.Index)})
	}
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(metrics.New(targets, metrics.DefaultTimeout)); err != nil {
		return nil, nil, err
	}
	return cfg, reg, nil
}

func metricsDump(c *cli.Context) error {
	if c.NArg() > 0 {
		return usagef("metrics dump takes no arguments, got %q", c.Args().First())
	}
	_, reg, err := metricsRegistry(c)
	if err != nil {
		return err
	}
	return writeMetrics(c.App.Writer, reg)
}

// writeMetrics writes what reg gathers in Prometheus's text format.
func writeMetrics(w io.Writer, reg prometheus.Gatherer) error {
	mfs, err := reg.Gather()
	if err != nil {
		return err
	}
	enc := expfmt.NewEncoder(w, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return err
		}
	}
	return nil
}

func metricsServe(c *cli.Context) error {
	if c.NArg() > 0 {
		return usagef("metrics serve takes no arguments, got %q", c.Args().First())
	}
	cfg, reg, err := metricsRegistry(c)
	if err != nil {
		return err
	}
	addr := cfg.Metrics.Listen
	if c.IsSet("listen") {
		addr = c.String("listen")
		if err := (config.MetricsConfig{Listen: addr}).Validate(); err != nil {
			var ce *config.Error
			if errors.As(err, &ce) {
				err = ce.Err
			}
			return usagef("--listen %v", err)
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		EnableOpenMetrics: true,
		ErrorHandling:     promhttp.ContinueOnError,
		Timeout:           2 * metrics.DefaultTimeout,
	}))
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "mgpu metrics: /metrics (docs/metrics.md)\n")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	fmt.Fprintf(c.App.ErrWriter, "mgpu: serving metrics on http://%s/metrics\n", ln.Addr())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics: %w", err)
	}
	return nil
}

func init() {
	commands = append(commands, &cli.Command{
		Name:  "metrics",
		Usage: "export the node's GPU sharing state to Prometheus",
		Description: "One exporter per node reads every device's enforcer at each scrape: per device and\n" +
			"per instance (from admission on) quotas, memory used, measured GPU seconds,\n" +
			"throttled seconds, launches, queued work, processes, violations. docs/metrics.md\n" +
			"lists every metric; packaging/grafana/ has a dashboard.",
		Subcommands: []*cli.Command{
			{
				Name:      "serve",
				Usage:     "serve /metrics (OpenMetrics or Prometheus text) until SIGINT or SIGTERM",
				UsageText: "mgpu-cli metrics serve [--listen HOST:PORT]",
				Description: "Listens on [metrics] listen of the node config (default " + config.DefaultMetricsListen + ",\n" +
					"loopback only). A device whose enforcer does not answer has mgpu_device_up 0.",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "listen", Usage: "`HOST:PORT` to listen on (overrides [metrics] listen)"},
				},
				Action: metricsServe,
			},
			{
				Name:      "dump",
				Usage:     "print the metrics once, in Prometheus's text format",
				UsageText: "mgpu-cli metrics dump",
				Action:    metricsDump,
			},
		},
	})
}
