package k8s

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime"
	k8sjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
)

// ChartDir is the mgpu Helm chart, relative to this package.
const ChartDir = "../../charts/mgpu"

// helmBinary is the helm that make deps installs ($CACHE_DIR/bin/helm,
// /var/cache/mgpu by default), else one on PATH.
func helmBinary() (string, error) {
	cache := os.Getenv("CACHE_DIR")
	if cache == "" {
		cache = "/var/cache/mgpu"
	}
	if p := filepath.Join(cache, "bin", "helm"); executable(p) {
		return p, nil
	}
	if p, err := exec.LookPath("helm"); err == nil {
		return p, nil
	}
	return "", errors.New("helm is not installed (make deps installs it)")
}

// RenderChart runs helm template on the chart as release name in
// namespace, with the extra arguments (--set ...), and decodes every object
// strictly into its client-go type.
func RenderChart(t testing.TB, name, namespace string, args ...string) []runtime.Object {
	t.Helper()
	helm, err := helmBinary()
	if err != nil {
		t.Fatalf("k8s: %v", err)
	}
	home := t.TempDir()
	cmd := exec.Command(helm, append([]string{"template", name, ChartDir, "--namespace", namespace}, args...)...) //nolint:gosec // the test's helm
	cmd.Env = append(os.Environ(), "HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"), "HELM_DATA_HOME="+filepath.Join(home, "data"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("k8s: helm template: %v\n%s", err, stderr.String())
	}
	objs, err := decodeObjects(out)
	if err != nil {
		t.Fatalf("k8s: helm template: %v", err)
	}
	return objs
}

var strictDecoder = k8sjson.NewSerializerWithOptions(k8sjson.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
	k8sjson.SerializerOptions{Yaml: true, Strict: true})

// decodeObjects decodes a stream of YAML documents; documents of comments
// only are skipped.
func decodeObjects(data []byte) ([]runtime.Object, error) {
	var objs []runtime.Object
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, err
		}
		empty := true
		for l := range strings.Lines(string(doc)) {
			if s := strings.TrimSpace(l); s != "" && !strings.HasPrefix(s, "#") {
				empty = false
			}
		}
		if empty {
			continue
		}
		obj, _, err := strictDecoder.Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%w\n%s", err, doc)
		}
		objs = append(objs, obj)
	}
}
