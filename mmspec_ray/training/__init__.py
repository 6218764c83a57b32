"""mmspec_ray.training"""
