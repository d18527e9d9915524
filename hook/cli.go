package hook

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/internal/config"
)

// Exit statuses of mgpu-hook.
const (
	exitRefused = 1 // create: the container must not start
	exitUsage   = 2 // unknown command or flag
)

// grace is how long past its deadline (and rollback) a verb may run before
// Main gives up on it, whatever it is blocked in.
const grace = 500 * time.Millisecond

// usageText is mgpu-hook --help.
const usageText = `mgpu-hook - OCI hook of mgpu: admit a container's GPU shares, release them

Usage:
  mgpu-hook [--config FILE] [--timeout DURATION] create|destroy
  mgpu-hook --help

Runs from the hooks of the mgpu CDI spec, with the OCI state on stdin:
  createRuntime: mgpu-hook create   asks each requested device's enforcer for an instance
  poststop:      mgpu-hook destroy  releases the container's instances (idempotent, always exits 0)
Requests: annotations vke.volcengine.com/mgpu-core, vke.volcengine.com/mgpu-memory,
vke.volcengine.com/mgpu-compute-policy, or env MGPU_CORE, MGPU_MEMORY, MGPU_COMPUTE_POLICY
(annotations win). A Kubernetes pod's container (CRI annotations) gets its quota from
the node agent on <run_dir>/kube-agent.sock instead.

Options:
  --config FILE       node configuration (default $` + config.EnvPath + `, else ` + config.DefaultPath + `)
  --timeout DURATION  give up after DURATION (default %s; the CDI spec gives the hook
                      10s, and rollback adds up to %s)
  --help, -h          show this help

Exit status: 0 admitted (destroy: always), 1 refused (one line on stderr
that starts with "mgpu: "), 2 bad usage. See docs/hook.md.
`

// Main runs mgpu-hook and returns its exit status. A failure is one line on
// stderr that starts with "mgpu: ".
//
// The command line is parsed with the standard library's flag package: the
// runtime waits for the hook at every container start, and a CLI framework's
// initialisation is time it would wait for.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer, opts ...Option) int {
	err := run(args, stdin, stdout, stderr, opts)
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "mgpu: %s\n", oneLine(err))
	var ue usageError
	if errors.As(err, &ue) {
		return exitUsage
	}
	return exitRefused
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer, opts []Option) error {
	fs := flag.NewFlagSet("mgpu-hook", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfgPath := fs.String("config", "", "")
	timeout := fs.Duration("timeout", DefaultTimeout, "")
	if len(args) > 0 {
		args = args[1:]
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(stdout, usageText, DefaultTimeout, RollbackTimeout)
			return nil
		}
		return usageError{err}
	}
	if fs.NArg() == 0 {
		return usageError{errors.New("no command (want create or destroy; see mgpu-hook --help)")}
	}
	verb, rest := fs.Arg(0), fs.Args()[1:]
	if verb != "create" && verb != "destroy" {
		return usageError{fmt.Errorf("unknown command %q (want create or destroy)", verb)}
	}
	if len(rest) == 1 && (rest[0] == "--help" || rest[0] == "-help" || rest[0] == "-h") {
		fmt.Fprintf(stdout, usageText, DefaultTimeout, RollbackTimeout)
		return nil
	}
	if len(rest) > 0 {
		return usageError{fmt.Errorf("%s takes no arguments, got %q (flags go before the command)", verb, strings.Join(rest, " "))}
	}
	if *timeout <= 0 {
		return usageError{fmt.Errorf("--timeout must be positive, got %s", *timeout)}
	}
	path := config.Resolve(*cfgPath)
	if verb == "create" {
		return bounded(*timeout, verb, func(ctx context.Context) error {
			return runCreate(ctx, path, stdin, stderr, opts)
		})
	}
	if err := bounded(*timeout, verb, func(ctx context.Context) error {
		runDestroy(ctx, path, stdin, stderr, opts)
		return nil
	}); err != nil {
		fmt.Fprintf(stderr, "mgpu: destroy: %s\n", oneLine(err))
	}
	return nil
}

// bounded runs fn with the --timeout deadline and returns its error, or
// gives up grace after the deadline and rollback, whatever fn is blocked in.
func bounded(timeout time.Duration, verb string, fn func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	t := time.NewTimer(timeout + RollbackTimeout + grace)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return fmt.Errorf("%s gave up after %s (--timeout %s)", verb, timeout+RollbackTimeout+grace, timeout)
	}
}

func runCreate(ctx context.Context, cfgPath string, stdin io.Reader, stderr io.Writer, opts []Option) error {
	st, err := readState(ctx, stdin)
	if err != nil {
		return err
	}
	cfg, err := config.Load(cfgPath)
	if err != nil {
		return err
	}
	_, err = New(cfg, append([]Option{WithLog(stderr)}, opts...)...).Create(ctx, st)
	return err
}

func runDestroy(ctx context.Context, cfgPath string, stdin io.Reader, stderr io.Writer, opts []Option) {
	st, err := readState(ctx, stdin)
	if err != nil {
		fmt.Fprintf(stderr, "mgpu: destroy: %s\n", oneLine(err))
		return
	}
	cfg, err := config.Load(cfgPath)
	if err != nil {
		fmt.Fprintf(stderr, "mgpu: destroy %s: %s\n", st.ID, oneLine(err))
		return
	}
	_, errs := New(cfg, append([]Option{WithLog(stderr)}, opts...)...).Destroy(ctx, st)
	for _, e := range errs {
		fmt.Fprintf(stderr, "mgpu: destroy %s: %s\n", st.ID, oneLine(e))
	}
}

// readState parses the OCI state on r, giving up when ctx ends (a runtime
// that never closes stdin must not hang the hook).
func readState(ctx context.Context, r io.Reader) (*oci.State, error) {
	ch := make(chan struct {
		st  *oci.State
		err error
	}, 1)
	go func() {
		st, err := ParseState(r)
		ch <- struct {
			st  *oci.State
			err error
		}{st, err}
	}()
	select {
	case res := <-ch:
		return res.st, res.err
	case <-ctx.Done():
		return nil, fmt.Errorf("no OCI state on stdin within the timeout (%w)", ctx.Err())
	}
}

type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// oneLine folds a multi-line error into one line.
func oneLine(err error) string {
	return strings.TrimSpace(strings.NewReplacer("\r\n", "; ", "\n", "; ", "\r", "; ").Replace(err.Error()))
}
