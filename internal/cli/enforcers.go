package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/internal/device"
)

// Backoff of an enforcer that exits: doubled from enforcerBackoffMin up to
// enforcerBackoffMax, back to the minimum once it has run
// enforcerSteadyRun.
const (
	enforcerBackoffMin = time.Second
	enforcerBackoffMax = 30 * time.Second
	enforcerSteadyRun  = time.Minute
)

// supervise runs `enforcer --device N --config cfgPath` for every index
// and starts one again when it exits, until ctx ends; then it sends each
// SIGTERM and, after stop, SIGKILL. Lines about starts and exits go to log.
func supervise(ctx context.Context, enforcer, cfgPath string, indexes []int, stop time.Duration, stdout, stderr, log io.Writer) {
	var (
		wg sync.WaitGroup
		mu sync.Mutex // log
	)
	say := func(format string, a ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(log, format+"\n", a...)
	}
	for _, idx := range indexes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			backoff := enforcerBackoffMin
			for ctx.Err() == nil {
				cmd := exec.Command(enforcer, "--device", fmt.Sprint(idx), "--config", cfgPath) //nolint:gosec // the image's enforcer
				cmd.Stdout, cmd.Stderr = stdout, stderr
				cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
				start := time.Now()
				if err := cmd.Start(); err != nil {
					say("mgpu: enforcer of GPU %d: %v; starting it again in %v", idx, err, backoff)
				} else {
					say("mgpu: enforcer of GPU %d started (pid %d)", idx, cmd.Process.Pid)
					done := make(chan error, 1)
					go func() { done <- cmd.Wait() }()
					select {
					case err := <-done:
						if time.Since(start) >= enforcerSteadyRun {
							backoff = enforcerBackoffMin
						}
						say("mgpu: enforcer of GPU %d exited (%v); starting it again in %v", idx, exitText(err), backoff)
					case <-ctx.Done():
						_ = cmd.Process.Signal(syscall.SIGTERM)
						t := time.NewTimer(stop)
						select {
						case err := <-done:
							say("mgpu: enforcer of GPU %d stopped (%v)", idx, exitText(err))
						case <-t.C:
							_ = cmd.Process.Kill()
							say("mgpu: enforcer of GPU %d did not stop within %v: killed (%v)", idx, stop, exitText(<-done))
						}
						t.Stop()
						return
					}
				}
				t := time.NewTimer(backoff)
				select {
				case <-t.C:
				case <-ctx.Done():
					t.Stop()
					return
				}
				backoff = min(2*backoff, enforcerBackoffMax)
			}
		}()
	}
	wg.Wait()
}

func exitText(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

func nodeEnforcers(c *cli.Context) error {
	if c.NArg() > 0 {
		return usagef("node enforcers takes no arguments, got %q", c.Args().First())
	}
	cfg, err := loadConfig(c)
	if err != nil {
		return err
	}
	enforcer := c.String("enforcer")
	if enforcer == "" {
		self, err := os.Executable()
		if err != nil {
			return err
		}
		enforcer = filepath.Join(filepath.Dir(self), "mgpu-enforcer")
	}
	if _, err := os.Stat(enforcer); err != nil {
		return fmt.Errorf("the enforcer: %w", err)
	}
	devs, err := device.List(cfg)
	if err != nil {
		return err
	}
	if len(devs) == 0 {
		return fmt.Errorf("no GPUs found (backend %q): no enforcer to run", cfg.Backend)
	}
	var idx []int
	for _, d := range devs {
		idx = append(idx, d.Index)
	}
	cfgPath := cfg.Path()
	if abs, err := filepath.Abs(cfgPath); err == nil {
		cfgPath = abs
	}
	ctx, cancel := signal.NotifyContext(c.Context, syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	supervise(ctx, enforcer, cfgPath, idx, c.Duration("stop-timeout"), c.App.Writer, c.App.ErrWriter, c.App.ErrWriter)
	return nil
}

func init() {
	nodeCommand.Subcommands = append(nodeCommand.Subcommands, &cli.Command{
		Name:      "enforcers",
		Usage:     "run one enforcer per GPU of the node until SIGTERM (the Helm chart's enforcers container)",
		UsageText: "mgpu-cli --config FILE node enforcers [--enforcer PATH] [--stop-timeout DURATION]",
		Description: "Runs mgpu-enforcer --device N --config FILE for every GPU the configuration's backend\n" +
			"finds, and starts one again when it exits (after 1 s, doubling up to 30 s; back to 1 s\n" +
			"once it has run a minute). SIGTERM or SIGINT stops them all (SIGTERM, then SIGKILL after\n" +
			"--stop-timeout); an enforcer keeps its instances in the configuration's state_dir, so the\n" +
			"next one restores them. What systemd's mgpu-enforcers.service does on a package install.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "enforcer", Usage: "the mgpu-enforcer binary (`PATH`; default: beside mgpu-cli)"},
			&cli.DurationFlag{Name: "stop-timeout", Value: 20 * time.Second, Usage: "how long an enforcer has to stop after SIGTERM (`DURATION`)"},
		},
		Action: nodeEnforcers,
	})
}
