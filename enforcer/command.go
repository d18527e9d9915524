package enforcer

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/logging"
)

// Command is mgpu-enforcer: it parses args (without the program name), runs
// the enforcer of one device until SIGTERM or SIGINT, and returns the exit
// status. SIGHUP re-reads the configuration (see Reload). Fatal errors are
// one line on stderr.
func Command(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("mgpu-enforcer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dev := fs.Int("device", -1, "serve device `X` (NVML index)")
	cfgPath := fs.String("config", "", "node configuration `FILE` (default $"+config.EnvPath+" or "+config.DefaultPath+")")
	level := fs.String("log-level", "info", "`LEVEL`: debug, info, warn or error")
	format := fs.String("log-format", "text", "`FORMAT`: text or json")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(status int, format string, a ...any) int {
		fmt.Fprintf(stderr, "mgpu-enforcer: "+format+"\n", a...)
		return status
	}
	if fs.NArg() > 0 || *dev < 0 {
		return fail(2, "usage: mgpu-enforcer --device X [--config FILE]")
	}
	base, err := logging.New(stderr, *level, *format)
	if err != nil {
		return fail(2, "%v", err)
	}
	log := base.With("device", *dev)
	path := config.Resolve(*cfgPath)
	cfg, err := config.Load(path)
	if err != nil {
		return fail(2, "%v", err)
	}
	e, err := New(cfg, *dev, WithLogger(log))
	if err != nil {
		var ce *CorruptStateError
		if errors.As(err, &ce) || errors.Is(err, ErrRunning) {
			return fail(1, "%v", err)
		}
		return fail(1, "device %d: %v", *dev, err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for range hup {
			next, err := config.Load(path)
			if err != nil {
				log.Error("SIGHUP: configuration not reloaded", "err", err)
				continue
			}
			if err := e.Reload(next); err != nil {
				log.Error("SIGHUP", "err", err)
				continue
			}
			log.Info("SIGHUP: configuration reloaded", "path", path)
		}
	}()
	if err := e.Run(ctx); err != nil {
		return fail(1, "%v", err)
	}
	log.Info("stopped; instances and regions stay for the next start")
	return 0
}
