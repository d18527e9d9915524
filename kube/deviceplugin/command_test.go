package deviceplugin

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestCommand(t *testing.T) {
	t.Parallel()
	missing := filepath.Join(t.TempDir(), "config.toml")
	for _, tc := range []struct {
		name   string
		args   []string
		status int
		stdout []string // substrings
		stderr string   // substring of the one line
	}{
		{
			name: "help", args: []string{"--help"}, status: 0,
			stdout: []string{ResourceName, "mgpu-<gpu>-<k> with k = 00..99", "-config", "-device-plugin-dir", "/var/lib/kubelet/device-plugins", "-placement", "binpack or spread", "-kubeconfig", "-node-name", "-pod-resources-socket", "kube-agent.sock"},
		},
		{name: "unknown flag", args: []string{"--bogus"}, status: 2, stderr: "mgpu-device-plugin: flag provided but not defined: -bogus (see --help)"},
		{name: "argument", args: []string{"now"}, status: 2, stderr: `mgpu-device-plugin: takes no arguments, got "now"`},
		{name: "bad placement", args: []string{"--placement", "pack"}, status: 2, stderr: `mgpu-device-plugin: --placement: unknown placement "pack" (want binpack or spread)`},
		{name: "bad node interval", args: []string{"--node-interval", "0s"}, status: 2, stderr: "--node-interval 0s: must be positive"},
		{name: "empty directory", args: []string{"--device-plugin-dir="}, status: 2, stderr: "--device-plugin-dir is empty"},
		{name: "bad log level", args: []string{"--log-level", "loud"}, status: 2, stderr: `bad --log-level "loud"`},
		{name: "bad log format", args: []string{"--log-format", "xml"}, status: 2, stderr: `bad --log-format "xml"`},
		{name: "missing config", args: []string{"--config", missing}, status: 2, stderr: "configuration file not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var stdout, stderr bytes.Buffer
			if got := Command(tc.args, &stdout, &stderr); got != tc.status {
				t.Errorf("status %d, want %d (stderr %q)", got, tc.status, stderr.String())
			}
			for _, s := range tc.stdout {
				if !strings.Contains(stdout.String(), s) {
					t.Errorf("stdout lacks %q:\n%s", s, stdout.String())
				}
			}
			if tc.stderr == "" {
				if stderr.Len() > 0 {
					t.Errorf("stderr: %q", stderr.String())
				}
				return
			}
			if e := stderr.String(); !strings.Contains(e, tc.stderr) || strings.Count(e, "\n") != 1 {
				t.Errorf("stderr %q, want one line with %q", e, tc.stderr)
			}
		})
	}
}

func TestWaitForFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "kubelet.conf")
	done := make(chan error, 1)
	go func() { done <- waitForFile(context.Background(), path, testLogger()) }()
	select {
	case err := <-done:
		t.Fatalf("returned before the file exists: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(waitFor):
		t.Fatal("did not return once the file exists")
	}
	// Under a file: not "missing", an error.
	if err := waitForFile(context.Background(), filepath.Join(path, "x"), testLogger()); err == nil {
		t.Error("a path under a file: no error")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := waitForFile(ctx, filepath.Join(dir, "never"), testLogger()); err != nil {
		t.Errorf("ended context: %v", err)
	}
}
