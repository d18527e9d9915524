// Package kubeclient finds the API server the way mgpu's Kubernetes
// components do: a kubeconfig flag, else $KUBECONFIG, else the pod's
// service account.
package kubeclient

import (
	"errors"
	"fmt"
	"os"

	"k8s.io/client-go/kubernetes"
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

// Client is a clientset of Config(path).
func Client(path string) (kubernetes.Interface, error) {
	c, err := Config(path)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(c)
	if err != nil {
		return nil, fmt.Errorf("the API server: %w", err)
	}
	return cs, nil
}
