package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/policy"
)

// EnvShim overrides where mgpu-cli run finds the shim.
const EnvShim = "MGPU_SHIM"

// shimPath returns the shim to preload: --shim, then $MGPU_SHIM, then
// <prefix>/lib/mgpu/libmgpu-shim.so, then the build tree's
// build/lib/libmgpu-shim.so beside build/bin/mgpu-cli.
func shimPath(c *cli.Context, cfg *config.Config) (string, error) {
	if p := c.String("shim"); p != "" {
		return checkShim(p, "--shim")
	}
	if p := os.Getenv(EnvShim); p != "" {
		return checkShim(p, EnvShim)
	}
	tried := []string{filepath.Join(cfg.Prefix, "lib", "mgpu", "libmgpu-shim.so")}
	if exe, err := os.Executable(); err == nil {
		tried = append(tried, filepath.Join(filepath.Dir(exe), "..", "lib", "libmgpu-shim.so"))
	}
	for _, p := range tried {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return filepath.Clean(p), nil
		}
	}
	return "", fmt.Errorf("the shim is not installed (looked for %s); install mgpu, build it (make), or pass --shim PATH", strings.Join(tried, " and "))
}

func checkShim(p, from string) (string, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	if st, err := os.Stat(abs); err != nil || !st.Mode().IsRegular() {
		return "", usagef("%s %q: not a file", from, p)
	}
	return abs, nil
}

// exitStatus is the status of a command that did not exit 0. A plain
// non-zero exit is passed on silently (the command said what it had to
// say); a death by signal is reported.
type exitStatus struct {
	code   int
	msg    string
	silent bool
}

func (e exitStatus) Error() string { return e.msg }
func (e exitStatus) ExitCode() int { return e.code }

// runCommand is mgpu-cli run: a process-tree instance rooted at this
// process, CMD under the shim, the instance released when CMD ends.
func runCommand(c *cli.Context) error {
	args := c.Args().Slice()
	if len(args) == 0 {
		return usagef("say what to run: mgpu-cli run --device X --core C --memory M -- CMD [ARGS]")
	}
	for _, f := range []string{"device", "core", "memory"} {
		if !c.IsSet(f) {
			return usagef("--%s is required", f)
		}
	}
	if v := c.String("class"); v != "" {
		if _, err := policy.ParseClass(v); err != nil {
			return usagef("--class %q: want online or offline", v)
		}
	}
	cfg, devs, err := openDevices(c)
	if err != nil {
		return err
	}
	index := c.Int("device")
	if _, err := device.Find(devs, index); err != nil {
		return usageError{err}
	}
	shim, err := shimPath(c, cfg)
	if err != nil {
		return err
	}
	if c.Int("memory") < 0 {
		return usagef("--memory %d: want MiB >= 1", c.Int("memory"))
	}
	// Signals are caught before the instance exists, so that none is lost
	// between creating it and starting CMD.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)

	client := controlClient(cfg, index)
	ctx, cancel := context.WithTimeout(c.Context, controlTimeout)
	out, err := client.Create(ctx, api.CreateRequest{
		Kind: api.KindProcessTree, PID: os.Getpid(), Policy: c.String("policy"), Class: c.String("class"),
		Core: c.Int("core"), MemoryMiB: uint64(c.Int("memory")), //nolint:gosec // checked >= 0
	})
	cancel()
	if err != nil {
		return notRunning(index, err)
	}
	name := out.Instance.Name
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
		defer cancel()
		if _, err := client.Destroy(ctx, name); err != nil {
			fmt.Fprintf(c.App.ErrWriter, "mgpu: release %s: %v (the enforcer releases it once this process is gone)\n", name, err)
		}
	}()

	cmd := exec.Command(args[0], args[1:]...) //nolint:gosec // running the user's command is the point
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, c.App.Writer, c.App.ErrWriter
	cmd.Env = runEnv(os.Environ(), shim, cfg.RunDir, index)
	// CMD dies with mgpu-cli (even of SIGKILL), so that it never runs on
	// without its instance. Pdeathsig fires when the starting thread ends:
	// keep this goroutine on its thread until CMD is done.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("run %s: %w", args[0], err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case s := <-sigs:
			if s == syscall.SIGINT && terminalDelivered() {
				continue // the terminal sent ^C to CMD's process group already
			}
			_ = cmd.Process.Signal(s)
		case err := <-done:
			return commandStatus(args[0], err)
		}
	}
}

// runEnv is CMD's environment: the shim preloaded (before any LD_PRELOAD
// already set) and the device made visible.
func runEnv(env []string, shim, runDir string, index int) []string {
	out := make([]string, 0, len(env)+4)
	preload := shim
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "LD_PRELOAD":
			if v != "" {
				preload = shim + ":" + v
			}
		case "MGPU_RUN_DIR", "MGPU_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES":
		default:
			out = append(out, kv)
		}
	}
	x := strconv.Itoa(index)
	return append(out, "LD_PRELOAD="+preload, "MGPU_RUN_DIR="+runDir, "MGPU_VISIBLE_DEVICES="+x, "CUDA_VISIBLE_DEVICES="+x)
}

// terminalDelivered reports whether a SIGINT most likely came from the
// controlling terminal: stdin is a terminal whose foreground process group
// is ours (CMD's too).
func terminalDelivered() bool {
	fg, err := unix.IoctlGetInt(int(os.Stdin.Fd()), unix.TIOCGPGRP) //nolint:gosec // fd 0
	return err == nil && fg == unix.Getpgrp()
}

// commandStatus turns CMD's end into mgpu-cli's: its exit status, or
// 128+signal.
func commandStatus(name string, err error) error {
	if err == nil {
		return nil
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return fmt.Errorf("run %s: %w", name, err)
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	switch {
	case ok && ws.Signaled():
		return exitStatus{code: 128 + int(ws.Signal()), msg: fmt.Sprintf("%s was killed by signal %d (%v)", name, int(ws.Signal()), ws.Signal())}
	default:
		return exitStatus{code: ee.ExitCode(), msg: fmt.Sprintf("%s exited with status %d", name, ee.ExitCode()), silent: true}
	}
}

func init() {
	commands = append(commands, &cli.Command{
		Name:      "run",
		Usage:     "run a command with a GPU quota, without a container",
		UsageText: "mgpu-cli run --device X --core C --memory M [--policy P] [--class online|offline] [--shim PATH] -- CMD [ARGS]",
		Description: "Creates a process-tree instance on device X (its processes are mgpu-cli and every\n" +
			"descendant), runs CMD with the shim preloaded and the device visible, streams its\n" +
			"output, forwards SIGINT and SIGTERM, releases the instance when CMD ends and exits\n" +
			"with CMD's status (128+signal when it was killed). See docs/enforcer.md.",
		Flags: []cli.Flag{
			&cli.IntFlag{Name: "device", Aliases: []string{"d"}, Usage: "device `X` (NVML index)"},
			&cli.IntFlag{Name: "core", Usage: "compute quota `C`, percent of the device's time (1..100)"},
			&cli.IntFlag{Name: "memory", Usage: "device-memory quota `M` in MiB"},
			&cli.StringFlag{Name: "policy", Usage: "`P`, the policy the command expects; refused when the device runs another"},
			&cli.StringFlag{Name: "class", Usage: "priority `CLASS`: online (default) or offline, which runs only on time online instances leave (the device needs online_offline_switch 1 or 2)"},
			&cli.StringFlag{Name: "shim", Usage: "preload the shim at `PATH` (default: $" + EnvShim + ", then the installed one)"},
		},
		Action: runCommand,
	})
}
