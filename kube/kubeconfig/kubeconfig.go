// Package kubeconfig finds the API server the way mgpu's Kubernetes
// components do (a kubeconfig flag, else $KUBECONFIG, else the pod's
// service account) and, for the tools a user runs, the way kubectl does.
// It links no clientset: a tool that reads one API group builds its own
// typed client on the configuration (package kubeclient has the full
// clientset for the components).
package kubeconfig

import (
	"errors"
	"fmt"
	"os"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// ErrNone is returned (wrapped) when there is no kubeconfig and the process
// does not run in a pod.
var ErrNone = errors.New("no API server: set --kubeconfig FILE or $KUBECONFIG, or run in a pod with a service account")

// Config is the API server's configuration: path, else $KUBECONFIG, else
// in-cluster.
func Config(path string) (*rest.Config, error) {
	if path == "" {
		path = os.Getenv("KUBECONFIG")
	}
	if path != "" {
		c, err := clientcmd.BuildConfigFromFlags("", path)
		if err != nil {
			return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
		}
		return c, nil
	}
	c, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("%w (%w)", ErrNone, err)
	}
	return c, nil
}

// User is the API server's configuration as kubectl finds it: path, else
// $KUBECONFIG (a list of files, merged), else ~/.kube/config, else
// in-cluster.
func User(path string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = path
	c, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	switch {
	case err == nil:
		return c, nil
	case clientcmd.IsEmptyConfig(err):
		return nil, fmt.Errorf("%w; no %s either", ErrNone, clientcmd.RecommendedHomeFile)
	case path != "":
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	default:
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
}
