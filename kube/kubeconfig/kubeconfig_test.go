package kubeconfig

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeKubeconfig writes a kubeconfig of one cluster at server.
func writeKubeconfig(t *testing.T, server string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config")
	cfg := `apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: ` + server + `
users:
- name: u
  user:
    token: secret
contexts:
- name: ctx
  context:
    cluster: c
    user: u
current-context: ctx
`
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestUser(t *testing.T) {
	flag := writeKubeconfig(t, "https://flag.example:6443")
	env := writeKubeconfig(t, "https://env.example:6443")
	t.Setenv("KUBECONFIG", env)
	t.Setenv("KUBERNETES_SERVICE_HOST", "")

	c, err := User(flag)
	if err != nil || c.Host != "https://flag.example:6443" {
		t.Fatalf("the flag's file: %v %+v", err, c)
	}
	c, err = User("")
	if err != nil || c.Host != "https://env.example:6443" {
		t.Fatalf("$KUBECONFIG: %v %+v", err, c)
	}
	missing := filepath.Join(t.TempDir(), "none")
	if _, err := User(missing); err == nil || !strings.HasPrefix(err.Error(), "kubeconfig "+missing+": ") {
		t.Errorf("a missing file: %v", err)
	}
}

// TestUserNone: an empty $KUBECONFIG file (which hides
// ~/.kube/config) outside a pod is ErrNone.
func TestUserNone(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUBECONFIG", empty)
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, err := User(""); !errors.Is(err, ErrNone) || strings.Contains(err.Error(), "\n") {
		t.Errorf("err %v, want ErrNone in one line", err)
	}
}
